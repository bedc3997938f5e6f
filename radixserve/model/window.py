"""Which keys a sliding-window (local) attention layer reads, for one step's batch.

A local layer with window ``W`` lets the query at context index ``i`` see the keys
``i - W < j <= i`` (``W`` keys, itself included; transformers' and llama.cpp's convention).
Its attention reads only those keys, never the rest of the context:

- a decode token reads the last ``min(len, W)`` slots of its context (``DecodeWindow``);
- a prefill chunk (after a cached prefix or not) is cut into blocks of at most ``W`` query
  rows, each reading the keys from ``W - 1`` before its first row to its last row
  (``WindowBlock``), so a long chunk costs O(n W), not O(n^2), and the slots before the
  window (which a cache may have freed) are never touched;
- a sparse prefill's groups of rows likewise read from their first row's window start.

The plans depend only on the batch and ``W``, so a step computes them once and every local
layer reuses them (``plans``, memoized on the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.model.forward_batch import ForwardBatch, PrefillSpan


@dataclass
class DecodeWindow:
    context: torch.Tensor  # [B, min(max_len, W)] the slots read, padded past ``lens``
    lens: torch.Tensor  # [B] slots read per token
    bias: torch.Tensor  # [1, B, 1, width]: 0 or -inf


@dataclass
class WindowBlock:
    """Span rows ``[lo, hi)`` attend to context indices ``[key_lo, key_hi)`` under ``mask``."""

    lo: int
    hi: int
    key_lo: int
    key_hi: int
    mask: torch.Tensor  # [hi - lo, key_hi - key_lo] bool


@dataclass
class WindowPlan:
    decode: DecodeWindow | None
    spans: list[list[WindowBlock]]  # per prefill span of the batch


def plans(batch: ForwardBatch, window: int) -> WindowPlan:
    """The batch's plan for window ``window`` (made on first use, then reused)."""
    plan = batch.windows.get(window)
    if plan is None:
        decode = None
        if batch.num_decode:
            decode = decode_window(batch.decode_context, batch.decode_lens, window)
        device = batch.input_ids.device
        spans = [span_blocks(span, window, device) for span in batch.prefill_spans]
        plan = batch.windows[window] = WindowPlan(decode, spans)
    return plan


def decode_window(context: torch.Tensor, lens: torch.Tensor, window: int) -> DecodeWindow:
    start = (lens - window).clamp(min=0)
    width = min(context.shape[1], window)
    index = start[:, None] + torch.arange(width, device=context.device)[None, :]
    valid = index < lens[:, None]
    slots = context.gather(1, index.clamp(max=context.shape[1] - 1))
    bias = torch.zeros(valid.shape, device=context.device).masked_fill_(~valid, float("-inf"))
    return DecodeWindow(slots, lens - start, bias[None, :, None, :])


def span_blocks(span: PrefillSpan, window: int, device: torch.device) -> list[WindowBlock]:
    """Blocks of ``span``'s rows, each with the keys its rows' windows cover."""
    if span.sparse:  # sparse: its groups' rows, any context indices
        return [_block(g.lo, g.hi, g.rows.cpu(), window, device) for g in span.groups(device)]
    rows = torch.arange(span.prefix_len, span.prefix_len + span.num_new)
    return [
        _block(lo, min(lo + window, span.num_new), rows[lo : lo + window], window, device)
        for lo in range(0, span.num_new, window)
    ]


def _block(lo: int, hi: int, rows: torch.Tensor, window: int, device: torch.device) -> WindowBlock:
    key_lo, key_hi = max(0, int(rows[0]) - window + 1), int(rows[-1]) + 1
    keys = torch.arange(key_lo, key_hi)
    mask = (keys[None, :] <= rows[:, None]) & (keys[None, :] > rows[:, None] - window)
    return WindowBlock(lo, hi, key_lo, key_hi, mask.to(device))
