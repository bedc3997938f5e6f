"""Attention over the paged KV pool, for a packed batch of prefill chunks and decode tokens.

A forward step packs the new tokens of every scheduled sequence into one ``[T, ...]`` tensor:
first the decode tokens (one per sequence), then each prefill chunk. ``ForwardBatch`` says
where each new token's K/V goes (``out_slots``) and which slots each sequence attends to.

- Decode tokens are batched: their context slots are padded to ``[B, max_len]`` and read in
  one gather per layer; the grouped query heads of a KV head ride as the query-length axis,
  so KV heads are never repeated.
- A prefill chunk with no cached prefix attends causally to its own fresh K/V, read from the
  projection output, not the pool. A chunk after a cached prefix (or an earlier chunk)
  gathers prefix + chunk K/V from the pool and uses a lower-right causal mask.
- A sparse prefill (``SparsePrefill``) is the general case of that chunk: any sorted set of
  rows of a context, each attending to the context up to its own index (the KV of the rows
  not computed is whatever the pool holds there, e.g. KV reused from a segment store). RoPE
  positions are ``pos_offset + row``. A plain chunk is the rows ``[prefix_len, len)``.
  Its rows are attended in groups of ``SPARSE_GROUP`` (``SparseGroup``), each against the
  context only up to its own last row: one masked call over the whole context would pay for
  every masked-out pair, which for rows spread through a long context is most of them.
- A layer with a sliding window reads only the keys inside its window (``window.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.cache.kv_pool import KVPool
from radixserve.model import native
from radixserve.model.forward_batch import ForwardBatch, PrefillSpan, SparseGroup, SparsePrefill
from radixserve.model.window import WindowBlock, plans

# Rows of a sparse prefill attended per call: small enough that a group's masked-out pairs
# are few, large enough that the attention kernel still works on full query blocks.
SPARSE_GROUP = 64


def build_forward_batch(
    decode: list[tuple[int, int, torch.Tensor]],
    prefill: list[tuple[torch.Tensor, int, torch.Tensor, int] | SparsePrefill],
    device: torch.device,
    pad_slot: int,
    decode_sequences: int | None = None,
) -> ForwardBatch:
    """Pack a step.

    ``decode``: per row ``(token_id, position, context_slots)``, the context including the
    slot of the new token; one row per sequence, unless ``decode_sequences`` says the rows
    belong to fewer (a sequence verifying a draft has a row per token, each with its context
    up to its own slot: every row's K/V is written before any row attends).
    ``prefill``: per chunk ``(token_ids, prefix_len, context_slots, wants_logits)`` with
    ``context_slots`` covering prefix + chunk, or a ``SparsePrefill``; ``wants_logits`` is
    how many of the chunk's last tokens get a logits row (a bool: one).
    Padding reads ``pad_slot``.
    """
    ids, pos, out = [], [], []
    logits_rows: list[int] = []
    decode_context = decode_bias = decode_lens = None
    if decode:
        lens = torch.tensor([len(c) for _, _, c in decode])
        ctx = torch.nn.utils.rnn.pad_sequence(
            [c for _, _, c in decode], batch_first=True, padding_value=pad_slot
        )
        decode_context = ctx.to(device)
        past_end = torch.arange(ctx.shape[1])[None, :] >= lens[:, None]
        decode_bias = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))
        decode_bias = decode_bias[None, :, None, :].to(device)
        decode_lens = lens.to(device)
        ids.append(torch.tensor([t for t, _, _ in decode]))
        pos.append(torch.tensor([p for _, p, _ in decode]))
        out.append(torch.stack([c[-1] for _, _, c in decode]))
        logits_rows.extend(range(len(decode)))
    spans = []
    row = len(decode)
    for item in prefill:
        if isinstance(item, SparsePrefill):
            span, token_ids, positions, out_slots = _sparse_span(item, row, device)
            wants_logits = item.wants_logits
        else:
            token_ids, prefix_len, context_slots, wants_logits = item
            n = len(token_ids)
            span = PrefillSpan(start=row, num_new=n, prefix_len=prefix_len)
            if prefix_len > 0:
                span.context_slots = context_slots.to(device)
                mask = torch.ones(n, prefix_len + n, dtype=torch.bool).tril(prefix_len)
                span.mask = mask.to(device)
            positions = torch.arange(prefix_len, prefix_len + n)
            out_slots = context_slots[prefix_len:]
        spans.append(span)
        ids.append(torch.as_tensor(token_ids))
        pos.append(positions)
        out.append(out_slots)
        row += span.num_new
        if wants_logits:
            logits_rows.extend(range(row - int(wants_logits), row))
    return ForwardBatch(
        input_ids=torch.cat(ids).to(device=device, dtype=torch.int64),
        positions=torch.cat(pos).to(device),
        out_slots=torch.cat(out).to(device=device, dtype=torch.int64),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        num_decode=len(decode),
        decode_sequences=len(decode) if decode_sequences is None else decode_sequences,
        decode_context=decode_context,
        decode_bias=decode_bias,
        decode_lens=decode_lens,
        prefill_spans=spans,
    )


def _sparse_span(
    item: SparsePrefill, row: int, device: torch.device
) -> tuple[PrefillSpan, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = item.rows.to(torch.int64)
    n, ctx = rows.numel(), item.context_slots.numel()
    if n == 0 or n != len(item.token_ids):
        raise ValueError(f"a sparse prefill needs one token id per row ({len(item.token_ids)} "
                         f"ids, {n} rows)")  # fmt: skip
    if int(rows[-1]) >= ctx or (n > 1 and bool((rows[1:] <= rows[:-1]).any())):
        raise ValueError("sparse prefill rows must be strictly increasing context indices")
    span = PrefillSpan(start=row, num_new=n, prefix_len=ctx - n)
    span.context_slots = item.context_slots.to(device)
    span.groups = []
    for lo in range(0, n, SPARSE_GROUP):
        hi = min(lo + SPARSE_GROUP, n)
        length = int(rows[hi - 1]) + 1
        mask = torch.arange(length)[None, :] <= rows[lo:hi, None]
        span.groups.append(SparseGroup(lo, hi, length, mask.to(device), rows[lo:hi].to(device)))
    return span, item.token_ids, rows + item.pos_offset, item.context_slots[rows]


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    pool: KVPool,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``q``: [T, H, D]; ``k``, ``v``: [T, KVH, D] for the new tokens. Returns [T, H, D].
    ``window``: the layer attends over that many tokens only (a local layer)."""
    pool.write(layer, batch.out_slots, k, v)
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
        if span.context_slots is None:
            ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            ks, vs = pool.gather(layer, span.context_slots)
        if span.groups is not None:
            _sparse_attention(q[rows], ks, vs, span.groups, out[rows], scale)
            continue
        out[rows] = _attend(q[rows], ks, vs, span.mask, scale)
    return out


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
            ks, vs = _block_keys(layer, k, v, span, blk, pool)
            out[rows] = _attend(q[rows], ks, vs, blk.mask, scale)


def _block_keys(layer: int, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan,
                blk: WindowBlock, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The K/V ``[KVH, keys, D]`` of a window block: the chunk's fresh rows, or the pool's."""
    if span.context_slots is None:
        keys = slice(span.start + blk.key_lo, span.start + blk.key_hi)
        return k[keys].transpose(0, 1), v[keys].transpose(0, 1)
    return pool.gather(layer, span.context_slots[blk.key_lo : blk.key_hi])


def _decode_attention(layer: int, q: torch.Tensor, context: tuple, pool: KVPool,
                      scale: float) -> torch.Tensor:  # fmt: skip
    """One query token per sequence, against its context slots ``(slots [B, L], lens [B],
    bias [1, B, 1, L])``. Scores are laid out [KVH, B, group, L]: a KV head's query heads
    share each K/V row read."""
    b, num_heads, dim = q.shape
    num_kv = pool.shape.num_kv_heads
    ctx, lens, bias = context
    ops = native.paged_ops() if pool.device.type == "cpu" and dim % 16 == 0 else None
    if ops is not None:  # straight from the pool, no gathered copy of K and V
        k_layer, v_layer = pool.layer_kv(layer)
        slots = pool.slots_for(layer, ctx)
        scores = ops.paged_scores(q.contiguous(), k_layer, slots, lens)
        probs = scores.mul_(scale).add_(bias).softmax(dim=-1)
        return ops.paged_values(probs, v_layer, slots, lens)
    kc, vc = pool.gather(layer, ctx.view(-1))
    kc, vc = kc.view(num_kv, b, ctx.shape[1], dim), vc.view(num_kv, b, ctx.shape[1], dim)
    # Two batched matmuls beat SDPA here: its CPU kernel is slow for 1-token queries.
    qd = q.view(b, num_kv, num_heads // num_kv, dim).transpose(0, 1)
    scores = torch.matmul(qd, kc.transpose(-1, -2)).float().mul_(scale)
    probs = scores.add_(bias).softmax(dim=-1).to(vc.dtype)
    return torch.matmul(probs, vc).transpose(0, 1).reshape(b, num_heads, dim)
