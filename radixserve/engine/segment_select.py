"""Which reused segment tokens a RAG prefill computes again (``SegmentBlender`` step 4).

Given the budget (the recompute ratio times the reused tokens), ``RecomputeSelector.pick``
takes the first ``first_tokens`` of each reused segment, then ranks the rest by a score read
at a probe layer: the layers before it are computed for every row (and kept), and at the
probe each row's fresh K/V is compared with the reused K/V the pool holds
(``LlamaModel.kv_deviation``). Scores (``deviation_on``): ``kvattn``, the default (``kv``
times ``attention``: a token both stale and read by the question; measured best, docs/decisions.md
"RAG segments"), ``kv`` (K and V deviation together), ``k``, ``v``
(CacheBlend's criterion), ``attention`` (the attention the question's rows, those after the
last segment, pay the token), or ``position`` (no probe: each segment's earliest tokens).
The top of the ranking is taken over all segments (``quota="global"``) or per segment in
proportion to its length (``"segment"``).

Two refinements, off by default and set as attributes (measurement hooks,
``benchmarks/rag/rag_selection.py``): ``deviation_from`` < ``deviation_layer`` scores every
layer of that range, each over its mean, summed; ``filter_layer`` > ``deviation_layer`` is
CacheBlend's gradual filtering in two steps: the probe picks ``filter_keep`` x the budget as
candidates, which are computed up to ``filter_layer`` and scored again there.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from radixserve.engine.request import Request
from radixserve.model.attention import SparsePrefill, build_forward_batch


class RecomputeSelector:
    def __init__(
        self,
        model: Any,
        pool: Any,
        first_tokens: int,
        deviation_layer: int,
        deviation_on: str = "kvattn",
        quota: str = "global",
    ):
        self.model = model
        self.pool = pool
        self.first_tokens = first_tokens
        self.deviation_layer = min(deviation_layer, len(model.layers) - 1)
        self.deviation_from = self.deviation_layer  # the first probe layer (summed to the last)
        self.filter_layer = 0  # gradual filtering: off while <= deviation_layer
        self.filter_keep = 2.0
        self.deviation_on = deviation_on
        self.quota = quota

    def pick(self, req, start, n, reused, compute, budget: int) -> torch.Tensor:
        """``budget`` reused indices: the first tokens of each segment, then those whose K/V
        deviates most, over all segments (``quota="global"``) or within each segment's share
        of the budget, in proportion to its length (``quota="segment"``)."""
        reusable = ~compute
        reusable[:start] = False
        picked: list[int] = []
        for s, e in reused:
            take = range(s, min(s + self.first_tokens, e))
            picked.extend(i for i in take if reusable[i])
        picked = picked[:budget]
        reusable[picked] = False
        rest = budget - len(picked)
        if rest > 0 and rest >= int(reusable.sum()):
            picked.extend(reusable.nonzero().flatten().tolist())
        elif rest > 0:
            score = torch.full((n,), -1.0)
            score[start:] = self._score(req, start, n)
            score[~reusable] = -1.0
            if self.filter_layer > self.deviation_layer and self.deviation_on != "position":
                keep = min(int(reusable.sum()), math.ceil(self.filter_keep * rest))
                candidates = self._top(score, reusable, reused, keep)
                score = self._refine(req, n, compute, picked + candidates, candidates, reusable)
            picked.extend(self._top(score, reusable, reused, rest))
        return torch.tensor(sorted(picked), dtype=torch.int64)

    def _score(self, req: Request, start: int, n: int) -> torch.Tensor:
        """Per token of ``[start, n)``: the deviation the selection ranks by; with several
        probe layers, each layer's score over its mean, summed (their scales differ)."""
        if self.deviation_on == "position":  # no probe: earliest in its segment first
            return -torch.arange(start, n, dtype=torch.float32) / n
        rows = torch.arange(start, n)
        score = self._rank(self._deviation(req, rows, n, self.deviation_from, self.deviation_layer))
        return (score / score.mean(dim=1, keepdim=True).clamp_min(1e-12)).sum(dim=0)

    def _rank(self, dev: torch.Tensor) -> torch.Tensor:
        """The score ``deviation_on`` names, per probe layer and row of ``dev [.., rows, 3]``."""
        kv = dev[..., :2].square().sum(dim=-1).sqrt()
        return {"attention": dev[..., 2], "k": dev[..., 0], "v": dev[..., 1], "kv": kv,
                "kvattn": kv * dev[..., 2]}[self.deviation_on]  # fmt: skip

    def _refine(self, req: Request, n: int, compute, fresh: list[int], candidates: list[int],
                reusable) -> torch.Tensor:  # fmt: skip
        """CacheBlend's gradual filtering, in two steps: compute the candidates (and every row
        computed anyway) up to ``filter_layer``, keeping their K/V there, and score the
        candidates again at that layer; the other reusable tokens rank after them."""
        rows = compute.clone()
        rows[fresh] = True
        rows[: req.num_computed] = False
        rows = rows.nonzero().flatten()
        dev = self._deviation(req, rows, n, self.filter_layer, self.filter_layer)
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

    def _deviation(self, req: Request, rows: torch.Tensor, n: int, first: int, last: int):
        """Per probe layer ``first..last`` and row of ``rows`` (context indices, computed up to
        ``last`` and kept): how far its reused K and V (columns 0, 1) are from a fresh
        computation, and the attention the question's rows (those after the last segment, all
        in ``rows``) pay it (column 2): ``[probe layers, rows, 3]``."""
        item = SparsePrefill(torch.from_numpy(req.token_ids[rows.numpy()]), rows,
                             req.kv.slots[:n])  # fmt: skip
        batch = build_forward_batch([], [item], self.model.device, self.pool.pad_slot)
        query_rows = n - max(e for _, e in req.segments)
        dev = self.model.kv_deviation(batch, self.pool, last, query_rows, first=first)
        return dev.float().cpu().clone()
