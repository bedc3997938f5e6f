"""Attention over the paged KV pool op by op in PyTorch: where the native kernels do not run
(CUDA, no compiler, ``RADIXSERVE_NATIVE=0``). Computes what ``flash_attention`` computes.

- Decode tokens are batched: their context slots are padded to ``[B, max_len]`` and read in
  one gather per layer; the grouped query heads of a KV head ride as the query-length axis,
  so KV heads are never repeated.
- A prefill chunk with no cached prefix attends causally to its own K/V: the fresh
  projection output, or, in an int8 pool, its rows read back from the pool (so every path
  sees the same rounded KV). A chunk after a cached prefix (or an earlier chunk) gathers
  prefix + chunk K/V from the pool and uses a lower-right causal mask.
- A sparse prefill's rows are attended in groups (``PrefillSpan.groups``), each against the
  context only up to its own last row: one masked call over the whole context would pay for
  every masked-out pair, which for rows spread through a long context is most of them.
- A layer with a sliding window reads only the keys inside its window (``window.py``).

``pool.gather`` decodes the pool's format (int8 codes times their scales) into the model's
dtype (keys in the model's channel order); against int8 keys the queries are rounded as the
native kernel rounds them, in the groups of the stored key order (``KVFormat.round_queries``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.cache.kv_pool import KVPool
from radixserve.model.forward_batch import ForwardBatch, PrefillSpan, SparseGroup
from radixserve.model.window import WindowBlock, plans


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
           pool: KVPool, scale: float, window: int | None) -> torch.Tensor:  # fmt: skip
    """``paged_attention`` after the pool write: [T, H, D]."""
    q = pool.layer_format(layer).round_queries(q, layer)
    out = torch.empty_like(q)
    if window is not None:
        _windowed(layer, q, k, v, batch, pool, scale, window, out)
        return out
    b = batch.num_decode
    if b:
        ctx = (batch.decode_context, batch.decode_lens, batch.decode_bias)
        out[:b] = _decode_attention(layer, q[:b], ctx, pool, scale)
    for span in batch.prefill_spans:
        rows = slice(span.start, span.start + span.num_new)
        if span.context_slots is not None:
            ks, vs = pool.gather(layer, span.context_slots)
        else:
            ks, vs = _fresh(layer, k[rows], v[rows], batch.out_slots[rows], pool)
        if span.sparse:
            _sparse_attention(q[rows], ks, vs, span.groups(q.device), out[rows], scale)
            continue
        mask = span.mask(q.device) if span.prefix_len > 0 else None
        out[rows] = _attend(q[rows], ks, vs, mask, scale)
    return out


def _fresh(layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
           pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A chunk's own K/V ``[KVH, n, D]``: as computed, or as an int8 pool holds them."""
    if pool.layer_format(layer).quantized:
        return pool.gather(layer, slots)
    return k.transpose(0, 1), v.transpose(0, 1)


def _attend(
    q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``q`` [n, H, D] against ``ks``/``vs`` [KVH, c, D]; no mask: causal. Returns [n, H, D]."""
    # [1, heads, n, D]: the CPU flash kernel wants a batch axis (3-D inputs fall back to
    # the slow reference path) and handles grouped KV heads itself.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], ks[None], vs[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return o[0].transpose(0, 1)


def _sparse_attention(
    q: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    groups: list[SparseGroup],
    out: torch.Tensor,
    scale: float,
) -> None:
    """A sparse span's rows, group by group, each against the context it can see; into ``out``
    (a view of the step's output)."""
    for g in groups:
        if g.mask.dtype == torch.bool:  # additive once, not converted again by every layer
            g.mask = torch.zeros(g.mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~g.mask, float("-inf")
            )
        c = g.context_len
        out[g.lo : g.hi] = _attend(q[g.lo : g.hi], ks[:, :c], vs[:, :c], g.mask, scale)


def _windowed(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              batch: ForwardBatch, pool: KVPool, scale: float, window: int,
              out: torch.Tensor) -> None:  # fmt: skip
    """A local layer's attention into ``out``: each row reads its window's keys only."""
    plan = plans(batch, window)
    b = batch.num_decode
    if plan.decode is not None:
        d = plan.decode
        out[:b] = _decode_attention(layer, q[:b], (d.context, d.lens, d.bias), pool, scale)
    for span, blocks in zip(batch.prefill_spans, plan.spans, strict=True):
        base = span.start
        for blk in blocks:
            rows = slice(base + blk.lo, base + blk.hi)
            ks, vs = _block_keys(layer, k, v, span, blk, pool, batch.out_slots)
            out[rows] = _attend(q[rows], ks, vs, blk.mask, scale)


def _block_keys(layer: int, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan,
                blk: WindowBlock, pool: KVPool,
                out_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The K/V ``[KVH, keys, D]`` of a window block: the chunk's fresh rows, or the pool's."""
    if span.context_slots is None:
        keys = slice(span.start + blk.key_lo, span.start + blk.key_hi)
        return _fresh(layer, k[keys], v[keys], out_slots[keys], pool)
    return pool.gather(layer, span.context_slots[blk.key_lo : blk.key_hi])


def _decode_attention(layer: int, q: torch.Tensor, context: tuple, pool: KVPool,
                      scale: float) -> torch.Tensor:  # fmt: skip
    """One query token per sequence, against its context slots ``(slots [B, L], lens [B],
    bias [1, B, 1, L])``. Scores are laid out [KVH, B, group, L]: a KV head's query heads
    share each K/V row read."""
    b, num_heads, dim = q.shape
    num_kv = pool.shape.num_kv_heads
    ctx, _, bias = context
    kc, vc = pool.gather(layer, ctx.reshape(-1))
    kc, vc = kc.view(num_kv, b, ctx.shape[1], dim), vc.view(num_kv, b, ctx.shape[1], dim)
    # Two batched matmuls beat SDPA here: its CPU kernel is slow for 1-token queries.
    qd = q.view(b, num_kv, num_heads // num_kv, dim).transpose(0, 1)
    scores = torch.matmul(qd, kc.transpose(-1, -2)).float().mul_(scale)
    probs = scores.add_(bias).softmax(dim=-1).to(vc.dtype)
    return torch.matmul(probs, vc).transpose(0, 1).reshape(b, num_heads, dim)
