"""Research variants of the RAG recompute selection, for ``rag_selection.py`` to compare.

The product keeps one selection (``radixserve/engine/segment_select.py``: anchors, then K/V
deviation times attention at one probe layer, the top over all segments). ``SelectionVariants``
adds, as attributes a benchmark sets per variant:

- ``deviation_on``: what ranks the tokens: ``kvattn`` (the product's), ``kv`` (K and V
  deviation together), ``k``, ``v`` (CacheBlend's criterion), ``attention`` (the attention
  the question's rows pay the token) or ``position`` (no probe: each segment's earliest
  tokens first);
- ``quota``: ``global`` (the top over all segments) or ``segment`` (each segment a share of the
  budget in proportion to what it has left, its own top);
- ``deviation_from`` < ``deviation_layer``: every layer of that range scored, each over its
  mean, summed;
- ``filter_layer`` > ``deviation_layer``: CacheBlend's gradual filtering in two steps: the
  probe picks ``filter_keep`` x the budget as candidates, which are computed up to
  ``filter_layer`` and scored again there.
"""

from __future__ import annotations

import math

import torch

from radixserve.engine.segment_select import RecomputeSelector

SCORES = ("kv", "k", "v", "attention", "kvattn", "position")
QUOTAS = ("global", "segment")


class SelectionVariants(RecomputeSelector):
    def __init__(self, model, pool, first_tokens: int, deviation_layer: int,
                 deviation_on: str = "kvattn", quota: str = "global"):  # fmt: skip
        super().__init__(model, pool, first_tokens, deviation_layer)
        self.deviation_from = self.deviation_layer  # the first probe layer (summed to the last)
        self.filter_layer = 0  # gradual filtering: off while <= deviation_layer
        self.filter_keep = 2.0
        self.deviation_on = deviation_on
        self.quota = quota

    @classmethod
    def replacing(cls, selector: RecomputeSelector) -> SelectionVariants:
        """Variants over the model, pool and settings of an engine's selector."""
        return cls(selector.model, selector.pool, selector.first_tokens,
                   selector.deviation_layer)  # fmt: skip

    def score(self, req, start: int, n: int) -> torch.Tensor:
        if self.deviation_on == "position":  # no probe: earliest in its segment first
            return -torch.arange(start, n, dtype=torch.float32) / n
        rows = torch.arange(start, n)
        dev = self.deviation(req, rows, n, self.deviation_from, self.deviation_layer)
        score = self._rank(dev)
        return (score / score.mean(dim=1, keepdim=True).clamp_min(1e-12)).sum(dim=0)

    def _rank(self, dev: torch.Tensor) -> torch.Tensor:
        """The score ``deviation_on`` names, per probe layer and row of ``dev [.., rows, 3]``."""
        kv = dev[..., :2].square().sum(dim=-1).sqrt()
        return {"attention": dev[..., 2], "k": dev[..., 0], "v": dev[..., 1], "kv": kv,
                "kvattn": kv * dev[..., 2]}[self.deviation_on]  # fmt: skip

    def choose(self, req, n, compute, picked, score, reusable, reused, k: int) -> list[int]:
        if self.filter_layer > self.deviation_layer and self.deviation_on != "position":
            keep = min(int(reusable.sum()), math.ceil(self.filter_keep * k))
            candidates = self._top(score, reusable, reused, keep)
            score = self._refine(req, n, compute, picked + candidates, candidates, reusable)
        return self._top(score, reusable, reused, k)

    def _refine(self, req, n: int, compute, fresh: list[int], candidates: list[int],
                reusable) -> torch.Tensor:  # fmt: skip
        """Compute the candidates (and every row computed anyway) up to ``filter_layer``,
        keeping their K/V there, and score the candidates again at that layer; the other
        reusable tokens rank after them."""
        rows = compute.clone()
        rows[fresh] = True
        rows[: req.num_computed] = False
        rows = rows.nonzero().flatten()
        dev = self.deviation(req, rows, n, self.filter_layer, self.filter_layer)
        again = self._rank(dev)[0]
        score = torch.where(reusable, -0.5, -1.0)
        is_candidate = torch.zeros(n, dtype=torch.bool)
        is_candidate[candidates] = True
        take = is_candidate[rows]
        score[rows[take]] = again[take]
        return score

    def _top(self, score, reusable, reused, budget: int) -> list[int]:
        if self.quota == "global":
            return torch.topk(score, budget).indices.tolist()
        # each segment's share of the budget, in proportion to what it has left to pick
        left = [int(reusable[s:e].sum()) for s, e in reused]
        exact = [budget * m / sum(left) for m in left]
        share = [math.floor(x) for x in exact]
        by_remainder = sorted(range(len(left)), key=lambda k: share[k] - exact[k])
        for k in by_remainder[: budget - sum(share)]:
            share[k] += 1
        out: list[int] = []
        for (s, e), k in zip(reused, share, strict=True):
            if k:
                out.extend((torch.topk(score[s:e], k).indices + s).tolist())
        return out
