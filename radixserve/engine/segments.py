"""RAG segments: reuse the KV of documents that are not a prefix of the prompt.

A request may mark token ranges of its prompt as reusable segments (retrieved passages).
Each segment's KV is stored standalone, computed from position 0 with no context, in the
prefix tree itself under a segment namespace (``segment_namespace``). The tree's pool, lock
counts, eviction and integrity checks therefore apply unchanged; a segment is keyed by its
content (and the request's namespace), not by where it sits in a prompt.

Prefilling a request with segments (``SegmentBlender.prefill``), in one step:

1. the prefix tree has already served the prompt's cached prefix (the scheduler's match);
2. each segment after it is looked up in the segment namespace; a miss (or the part past a
   partial match) is computed standalone and inserted, so the next prompt finds it;
   (a segment evicted to the host tier is loaded back first, as a prefix would be);
3. the stored K/V is copied into the request's slots, keys rotated to the segment's position
   (``reanchor``); the tree's copy stays at position 0;
4. CacheBlend-style partial recomputation restores cross-segment attention: every token that
   is not reused is computed, plus ``ratio`` of the reused ones: the first tokens of each
   segment, then those whose K/V at an early layer deviates most from the reused K/V,
   weighted by the attention the question pays them there (``segment_select.py``);
5. one sparse forward computes those rows over the whole context and gives the logits.

The KV past the first reused token is approximate, so only the exact part before it is ever
inserted into the prefix tree (``RequestKV.limit_publish``). With ratio 1.0 every token is
recomputed and the result is a plain prefill's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.cache.base import Namespace, PrefixCache
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.request import Request
from radixserve.engine.segment_select import RecomputeSelector
from radixserve.model.attention import build_forward_batch
from radixserve.model.forward_batch import SparsePrefill
from radixserve.model.llama import rotate_half

SEGMENT_NAMESPACE = "rag-segment"


def segment_namespace(namespace: str | None) -> Namespace:
    """The tree namespace of a request's segments: apart from every prefix namespace."""
    return (SEGMENT_NAMESPACE, namespace)


@dataclass
class SegmentStats:
    """Monotonic counters, read by the metrics layer."""

    lookups: int = 0  # segments looked up in the segment store
    hits: int = 0  # found whole (page-aligned part) without computing anything
    fills: int = 0  # computed standalone (wholly or past a partial hit) and stored
    reused_tokens: int = 0  # tokens whose KV came from the store
    recomputed_tokens: int = 0  # reused tokens computed again by partial recomputation


@torch.inference_mode()
def reanchor(model: Any, pool: Any, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
    """Copy the K/V of slots ``src`` to ``dst`` in every layer, keys moved ``delta`` positions
    on: rotated by ``delta`` times each RoPE frequency (RoPE at position ``p + d`` is the
    rotation by ``d`` of RoPE at ``p``, for every scaling the model supports, which only
    rescales the frequencies); values are unchanged."""
    angle = float(delta) * model.rope_inv_freq.to(torch.float64)
    angle = torch.cat([angle, angle])
    cos = angle.cos().to(torch.float32)
    sin = angle.sin().to(torch.float32)
    # all layers in one gather and one scatter: a loop over layers costs ~8 small ops
    # each, which dominate when the machine is busy (each op waits for its threads)
    # keys decoded from the pool's format, rotated, encoded again (int8: new scales); values
    # are copied as stored
    dim = pool.shape.head_dim
    # (in the model's channel order: an int8 key order is undone and applied again)
    stores = [(pool.k, pool.v, pool.format, pool.main_layers)]
    if pool.has_float_layers:  # an int8 pool's layers kept in the model's dtype
        stores.append((pool.fk, pool.fv, pool.float_format, pool.float_layers))
    for keys, values, fmt, layers in stores:
        # [layers, kv_heads, n, dim]
        k = fmt.decode(keys.index_select(2, src), dim, torch.float32, layers)
        k = k * cos + rotate_half(k) * sin
        keys.index_copy_(2, dst, fmt.encode(k.to(pool.shape.dtype), keys_of=layers))
        values.index_copy_(2, dst, values.index_select(2, src))


class SegmentBlender:
    def __init__(
        self,
        model: Any,
        pool: Any,
        cache: PrefixCache,
        kv: RequestKV,
        ratio: float,
        select: RecomputeSelector,
        prefix_tokens: int = 0,
    ):
        self.model = model
        self.pool = pool
        self.cache = cache
        self.kv = kv
        self.ratio = ratio
        self.select = select  # which reused tokens to recompute (engine/segment_select.py)
        self.prefix_tokens = prefix_tokens  # the prompt's first tokens a segment is stored after
        self.stats = SegmentStats()

    def applies(self, req: Request, n: int) -> bool:
        """Does this prefill chunk (the request's next ``n`` tokens) reuse segments?"""
        if not req.segments or not self.cache.reuses_prefixes or req.spec.prefill_only:
            return False
        if self.model.config.sliding_layers:  # moving keys assumes one RoPE for every layer:
            return False  # a model with local layers computes its segments in full
        start = req.num_computed
        return start + n == req.num_tokens and any(s >= start for s, _ in req.segments)

    # ------------------------------------------------------------------ the prefill
    def prefill(self, req: Request) -> torch.Tensor:
        """Compute ``req``'s uncomputed tokens (slots already allocated) reusing its segments;
        return the last token's logits ``[1, vocab]``. The caller commits the tokens."""
        start, n = req.num_computed, req.num_tokens
        ns = segment_namespace(req.namespace)
        handles: list[Any] = []
        todo = [s for s in req.segments if s[0] >= start]
        prefix = req.token_ids[: min(self.prefix_tokens, req.segments[0][0])]
        try:
            reused = self._reuse(req, todo, prefix, ns, handles)
        finally:
            for h in handles:
                self.cache.dec_lock_ref(h)
        ratio = req.spec.recompute_ratio
        ratio = self.ratio if ratio is None else ratio
        rows = self._rows(req, start, n, reused, ratio)
        if reused:
            self.kv.limit_publish(req, min(s for s, _ in reused))
        slots = req.kv.slots[:n]
        item = SparsePrefill(torch.from_numpy(req.token_ids[rows.numpy()]), rows, slots,
                             wants_logits=True)  # fmt: skip
        batch = build_forward_batch([], [item], self.model.device, self.pool.pad_slot)
        return self.model.forward(batch, self.pool)

    def _reuse(
        self, req: Request, segments: list, prefix, ns: Any, handles: list
    ) -> list[tuple[int, int]]:
        """Copy each segment's stored K/V into ``req``'s slots at its position (storing it
        first when missing); return the reused ranges. Locks taken go into ``handles``.

        A segment is stored as ``prefix + segment`` (its K/V computed after the prefix, at
        positions ``len(prefix)`` on), so the tree shares one prefix among all segments
        stored after it and the key names both; only the segment's rows are reused."""
        page = self.cache.page_size
        p = len(prefix)
        reused = []
        for s, e in segments:
            ids = np.concatenate([prefix, req.token_ids[s:e]])
            aligned = len(ids) - len(ids) % page
            if aligned <= p:
                continue
            self.stats.lookups += 1
            match = self.cache.match_prefix(ids[:aligned], ns, record_stats=False)
            self.cache.inc_lock_ref(match.handle)
            handles.append(match.handle)
            if match.host_len and match.device_len < aligned:  # evicted to the host tier
                match = self.kv.tiers.load_back(match)
                self.cache.inc_lock_ref(match.handle)
                handles.append(match.handle)
            src = match.device_indices
            if match.device_len < aligned:
                src = self._fill(ids[:aligned], match.device_indices, ns, handles)
                if src is None:  # no room to store it: compute it in place instead
                    continue
                self.stats.fills += 1
            else:
                self.stats.hits += 1
                req.add_usage(segment_hits=req.usage.segment_hits + 1)
            n = aligned - p
            reanchor(self.model, self.pool, src[p:], req.kv.slots[s : s + n], s - p)
            reused.append((s, s + n))
        return reused

    def _fill(self, ids, cached: torch.Tensor, ns: Any, handles: list) -> torch.Tensor | None:
        """Compute a segment standalone past its cached part, insert it, lock it; return the
        tree's slots for all of it, or None when the pool has no room."""
        m = len(cached)
        new = self.kv.alloc_slots(len(ids) - m)
        if new is None:
            return None
        slots = torch.cat([cached, new])
        chunk = (torch.from_numpy(ids[m:].copy()), m, slots, False)
        batch = build_forward_batch([], [chunk], self.model.device, self.pool.pad_slot)
        try:
            self.model.forward(batch, self.pool)
        except Exception:
            self.kv.allocator.free(new)
            raise
        already = self.cache.insert(ids, slots, ns)
        self.kv.allocator.free(slots[m:already])  # inserted meanwhile: keep the tree's copy
        match = self.cache.match_prefix(ids, ns, record_stats=False)
        if match.device_len != len(ids):
            raise AssertionError(f"stored a {len(ids)}-token segment but {match.device_len} match")
        self.cache.inc_lock_ref(match.handle)
        handles.append(match.handle)
        return match.device_indices

    def _rows(
        self, req: Request, start: int, n: int, reused: list[tuple[int, int]], ratio: float
    ) -> torch.Tensor:
        """The context indices to compute: everything not reused, plus the recomputed ones."""
        compute = torch.ones(n, dtype=torch.bool)
        compute[:start] = False
        for s, e in reused:
            compute[s:e] = False
        compute[n - 1] = True  # its logits are the point of the prefill
        num_reused = int((~compute[start:]).sum())
        budget = min(num_reused, math.ceil(ratio * num_reused - 1e-9))
        if budget > 0:
            picked = self.select.pick(req, start, n, reused, compute, budget)
            compute[picked] = True
        recomputed = budget
        u = req.usage
        req.add_usage(reused_tokens=u.reused_tokens + num_reused - recomputed,
                      recomputed_tokens=u.recomputed_tokens + recomputed)  # fmt: skip
        self.stats.reused_tokens += num_reused - recomputed
        self.stats.recomputed_tokens += recomputed
        return compute.nonzero().flatten()
