"""Attention over the paged KV pool, for a packed batch of prefill chunks and decode tokens.

A forward step packs the new tokens of every scheduled sequence into one ``[T, ...]`` tensor:
first the decode tokens (one per sequence), then each prefill chunk. ``ForwardBatch`` says
where each new token's K/V goes (``out_slots``) and which slots each sequence attends to.

Every row attends to a range of its context's slots: a decode token to its whole context, a
prompt chunk's token to the prefix and the chunk up to itself, a sparse prefill's row
(``SparsePrefill``: any sorted rows of a context, RoPE positions ``pos_offset + row``) to the
context up to its own index, and in a layer with a sliding window only to the last ``W`` of
those. A layer first writes the step's K/V into the pool, then reads every row's keys from
the pool, in the pool's KV format:

- on CPU with the native kernels, in one call per layer (``flash_attention``,
  ``csrc/flash_attention.cpp``): ``RowRanges`` gives each row its context and range, built
  once per step; tiles of keys are read from the pool in place, scratch O(rows), never
  O(context^2); the queries in the order the keys are stored in (an int8 key order);
- elsewhere, op by op in PyTorch (``attention_torch.py``): the same function.
"""

from __future__ import annotations

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.model import attention_torch, native
from radixserve.model.forward_batch import ForwardBatch, PrefillSpan, RowRanges, SparsePrefill


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
    contexts, his = [], []  # the native attention's rows (RowRanges)
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
        contexts += list(ctx)
        his.append(lens)
    spans = []
    row = len(decode)
    for item in prefill:
        if isinstance(item, SparsePrefill):
            span, token_ids, positions, out_slots = _sparse_span(item, row, device)
            wants_logits, context, hi = item.wants_logits, item.context_slots, span.rows + 1
        else:
            token_ids, prefix_len, context, wants_logits = item
            n = len(token_ids)
            span = PrefillSpan(start=row, num_new=n, prefix_len=prefix_len)
            if prefix_len > 0:
                span.context_slots = context.to(device)
            positions = torch.arange(prefix_len, prefix_len + n)
            out_slots = context[prefix_len:]
            hi = torch.arange(prefix_len + 1, prefix_len + n + 1)
        spans.append(span)
        contexts.append(context)
        his.append(hi)
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
        ranges=_ranges(contexts, his, len(decode), [s.num_new for s in spans]),
    )


def _ranges(contexts: list[torch.Tensor], his: list[torch.Tensor], num_decode: int,
            span_rows: list[int]) -> RowRanges:  # fmt: skip
    """The rows' contexts and ranges as the native attention takes them (CPU)."""
    lengths = torch.tensor([len(c) for c in contexts], dtype=torch.int64)
    ctx_start = torch.zeros(len(contexts), dtype=torch.int64)
    if len(contexts) > 1:
        ctx_start[1:] = lengths[:-1].cumsum(0)
    rows = torch.tensor([1] * num_decode + span_rows, dtype=torch.int64)
    seq_start = torch.zeros(len(contexts) + 1, dtype=torch.int64)
    seq_start[1:] = rows.cumsum(0)
    ctx = torch.cat([c.to(torch.int64).cpu() for c in contexts]) if contexts else ctx_start
    hi = torch.cat([h.to(torch.int64).cpu() for h in his]) if his else ctx_start
    return RowRanges(ctx, ctx_start, seq_start, hi)


def _sparse_span(
    item: SparsePrefill, row: int, device: torch.device
) -> tuple[PrefillSpan, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = item.rows.to(torch.int64).cpu()
    n, ctx = rows.numel(), item.context_slots.numel()
    if n == 0 or n != len(item.token_ids):
        raise ValueError(f"a sparse prefill needs one token id per row ({len(item.token_ids)} "
                         f"ids, {n} rows)")  # fmt: skip
    if int(rows[-1]) >= ctx or (n > 1 and bool((rows[1:] <= rows[:-1]).any())):
        raise ValueError("sparse prefill rows must be strictly increasing context indices")
    span = PrefillSpan(start=row, num_new=n, prefix_len=ctx - n, rows=rows)
    span.context_slots = item.context_slots.to(device)
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
    ops = native.paged_ops() if pool.device.type == "cpu" and q.shape[-1] % 16 == 0 else None
    if ops is None or batch.ranges is None:
        return attention_torch.attend(layer, q, k, v, batch, pool, scale, window)
    r = batch.ranges
    ctx = r.window_ctx(pool.to_window) if pool.in_window(layer) else r.ctx
    k_layer, v_layer = pool.layer_kv(layer)
    fmt = pool.layer_format(layer)
    dtype = q.dtype
    q = fmt.stored_queries(q if dtype == torch.float32 else q.float(), layer)
    out = ops.flash_attention(
        q, k_layer, v_layer, fmt.kernel_code,
        fmt.group, ctx, r.ctx_start, r.seq_start, r.lo_for(window), r.hi, scale,
    )  # fmt: skip
    return out if dtype == torch.float32 else out.to(dtype)
