"""Which reused segment tokens a RAG prefill computes again (``SegmentBlender`` step 4).

Given the budget (the recompute ratio times the reused tokens), ``RecomputeSelector.pick``
takes the first ``first_tokens`` of each reused segment, then ranks the rest by a score read
at a probe layer: the layers before it are computed for every row (and kept), and at the
probe each row's fresh K/V is compared with the reused K/V the pool holds (``kv_deviation``,
over the model's layer-by-layer forward, ``forward_layers``). The score is K and V deviation
together times the attention the question's rows (those after the last segment) pay the
token: a token both stale and read by the question (the variant measured best,
docs/decisions.md "RAG segments"); the top of the ranking over all segments fills the budget.

Other selections (K, V or attention alone, position, per-segment quotas, several probe
layers, gradual filtering) were measured and rejected (docs/decisions.md, "RAG segments").
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.engine.request import Request
from radixserve.model.attention import build_forward_batch
from radixserve.model.forward_batch import ForwardBatch, SparsePrefill


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
        dev = kv_deviation(self.model, batch, self.pool, last, query_rows, first=first)
        return dev.float().cpu().clone()


@torch.inference_mode()
def kv_deviation(
    model: Any, batch: ForwardBatch, pool: KVPool, layer: int, query_rows: int = 1, first: int = 0
) -> torch.Tensor:
    """Run layers ``[0, layer)`` of ``batch`` (one sequence, writing their K/V); at each probe
    layer ``max(first, 1)`` to ``layer`` return, per row, the distance between the row's
    fresh K and what the pool held for it there (before this call), the same for V, and the
    attention the row gets there from the batch's last ``query_rows`` rows (summed over them
    and the heads; the batch's rows only, causal): ``[probe layers, rows, 3]``."""
    if not 0 < layer < len(model.layers) or first > layer:
        raise ValueError(
            f"the deviation layers must be in [1, {len(model.layers)}), first <= last; "
            f"got {first} to {layer}"
        )
    out = []
    for i, (q, k, v) in model.forward_layers(batch, pool, layer):
        if i < max(first, 1):
            continue
        old_k = pool.k[i][:, batch.out_slots].transpose(0, 1)
        old_v = pool.v[i][:, batch.out_slots].transpose(0, 1)
        dk = (k.float() - old_k.float()).square().sum(dim=(1, 2))
        dv = (v.float() - old_v.float()).square().sum(dim=(1, 2))
        att = attention_from_last(q, k, query_rows, model.scale)
        out.append(torch.stack([dk.sqrt(), dv.sqrt(), att], 1))
    return torch.stack(out)


def attention_from_last(q: torch.Tensor, k: torch.Tensor, m: int, scale: float) -> torch.Tensor:
    """Per row of ``k``, the attention the last ``m`` rows of ``q`` pay it (causal, summed over
    those rows and the heads; grouped K/V heads are shared by their query heads)."""
    t, group = k.shape[0], q.shape[1] // k.shape[1]
    m = max(1, min(m, t))
    keys = k.float().repeat_interleave(group, dim=1)  # [t, heads, head_dim]
    scores = torch.einsum("mhd,thd->hmt", q[t - m :].float(), keys) * scale
    rows = torch.arange(t, device=scores.device)
    late = rows[None, :] > rows[t - m :, None]  # causal
    scores.masked_fill_(late, float("-inf"))
    return scores.softmax(-1).sum(dim=(0, 1))
