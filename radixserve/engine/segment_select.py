"""Which reused segment tokens a RAG prefill computes again (``SegmentBlender`` step 4).

Given the budget (the recompute ratio times the reused tokens), ``RecomputeSelector.pick``
takes the first ``first_tokens`` of each reused segment, then ranks the rest by a score read
at a probe layer: the layers before it are computed for every row (and kept), and at the
probe each row's fresh K/V is compared with the reused K/V the pool holds
(``LlamaModel.kv_deviation``). The score is K and V deviation together times the attention
the question's rows (those after the last segment) pay the token: a token both stale and read
by the question (the variant measured best, docs/decisions.md "RAG segments"); the top of the
ranking over all segments fills the budget.

Other selections (K, V or attention alone, position, per-segment quotas, several probe
layers, gradual filtering) are research variants kept with the benchmark that compares them
(``benchmarks/rag/selection_variants.py``); they subclass this one through ``score`` and
``choose``.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.engine.request import Request
from radixserve.model.attention import build_forward_batch
from radixserve.model.forward_batch import SparsePrefill


class RecomputeSelector:
    def __init__(self, model: Any, pool: Any, first_tokens: int, deviation_layer: int):
        self.model = model
        self.pool = pool
        self.first_tokens = first_tokens
        self.deviation_layer = min(deviation_layer, len(model.layers) - 1)

    def pick(self, req, start, n, reused, compute, budget: int) -> torch.Tensor:
        """``budget`` reused indices: the first tokens of each segment, then those ranked
        highest by ``score`` (``choose``)."""
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
            score[start:] = self.score(req, start, n)
            score[~reusable] = -1.0
            picked.extend(self.choose(req, n, compute, picked, score, reusable, reused, rest))
        return torch.tensor(sorted(picked), dtype=torch.int64)

    def score(self, req: Request, start: int, n: int) -> torch.Tensor:
        """Per token of ``[start, n)``: K/V deviation times attention at the probe layer."""
        rows = torch.arange(start, n)
        dev = self.deviation(req, rows, n, self.deviation_layer, self.deviation_layer)
        score = dev[..., :2].square().sum(dim=-1).sqrt() * dev[..., 2]
        return (score / score.mean(dim=1, keepdim=True).clamp_min(1e-12)).sum(dim=0)

    def choose(self, req, n, compute, picked, score, reusable, reused, k: int) -> list[int]:
        """The ``k`` tokens to add to ``picked``: the top of ``score`` over all segments."""
        return torch.topk(score, k).indices.tolist()

    def deviation(self, req: Request, rows: torch.Tensor, n: int, first: int, last: int):
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
