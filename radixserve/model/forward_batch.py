"""The packed batch a forward step runs: where each new token's K/V goes and what it reads.

``ForwardBatch`` is made by ``attention.build_forward_batch`` and read by the models and by
the attention functions; ``PrefillSpan``, ``SparsePrefill`` and ``SparseGroup`` describe its
prefill chunks (see ``attention.py`` for how each kind is attended), ``RowRanges`` every row's
keys as the native kernel takes them. Data, and the masks of the PyTorch path made from it on
first use, so every module of the model package can name these types without importing the
attention code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SparseGroup:
    """Rows ``[lo, hi)`` of a sparse span, attending to the first ``context_len`` slots."""

    lo: int
    hi: int
    context_len: int
    mask: torch.Tensor  # [hi - lo, context_len]: bool, made additive once per step
    rows: torch.Tensor | None = None  # [hi - lo] the rows' context indices


# Rows of a sparse prefill attended per call on the PyTorch path: small enough that a group's
# masked-out pairs are few, large enough that the attention kernel still works on full query
# blocks.
SPARSE_GROUP = 64


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the packed batch
    num_new: int
    prefix_len: int  # tokens before this chunk whose K/V is already in the pool
    context_slots: torch.Tensor | None = None  # [prefix_len + num_new] when prefix_len > 0
    rows: torch.Tensor | None = None  # a sparse prefill's context indices (CPU int64)
    _mask: torch.Tensor | None = None
    _groups: list[SparseGroup] | None = None

    @property
    def sparse(self) -> bool:
        return self.rows is not None

    def mask(self, device: torch.device) -> torch.Tensor:
        """[num_new, prefix_len + num_new] bool: a chunk after a prefix, lower-right causal."""
        if self._mask is None:
            n, p = self.num_new, self.prefix_len
            self._mask = torch.ones(n, p + n, dtype=torch.bool).tril(p).to(device)
        return self._mask

    def groups(self, device: torch.device) -> list[SparseGroup]:
        """A sparse prefill's rows in groups of ``SPARSE_GROUP``, each against the context up
        to its own last row (made once per step)."""
        if self._groups is None:
            rows, self._groups = self.rows, []
            for lo in range(0, len(rows), SPARSE_GROUP):
                hi = min(lo + SPARSE_GROUP, len(rows))
                length = int(rows[hi - 1]) + 1
                mask = torch.arange(length)[None, :] <= rows[lo:hi, None]
                group = SparseGroup(lo, hi, length, mask.to(device), rows[lo:hi].to(device))
                self._groups.append(group)
        return self._groups


@dataclass
class RowRanges:
    """Every row of a step as the native attention takes it: row r reads the keys
    ``[lo[r], hi[r])`` of its context, ``ctx[ctx_start[s]:]`` for the context s with
    ``seq_start[s] <= r < seq_start[s + 1]`` (decode rows first, then each prefill span).
    ``lo`` is 0 except in window layers (``lo_for``); CPU int64 tensors."""

    ctx: torch.Tensor
    ctx_start: torch.Tensor
    seq_start: torch.Tensor
    hi: torch.Tensor
    _lo: dict[int, torch.Tensor] = field(default_factory=dict)
    _window_ctx: torch.Tensor | None = None

    def lo_for(self, window: int | None) -> torch.Tensor:
        """Each row's first key: 0, or in a window layer the first of its last ``window``."""
        key = window or 0
        if key not in self._lo:
            self._lo[key] = (self.hi - key).clamp_(min=0) if key else torch.zeros_like(self.hi)
        return self._lo[key]

    def window_ctx(self, to_window) -> torch.Tensor:
        """The contexts in a window pool's slots (``to_window`` maps them), made once."""
        if self._window_ctx is None:
            self._window_ctx = to_window(self.ctx)
        return self._window_ctx


@dataclass
class SparsePrefill:
    """Compute the tokens at ``rows`` (sorted indices into ``context_slots``) of one context.

    Row ``i`` attends to ``context_slots[: rows[i] + 1]``; its K/V goes to
    ``context_slots[rows[i]]``; its RoPE position is ``pos_offset + rows[i]``. With
    ``wants_logits`` the last row's next-token logits are returned.
    """

    token_ids: torch.Tensor  # [r] ids of the computed rows
    rows: torch.Tensor  # [r] int64, strictly increasing
    context_slots: torch.Tensor  # [c] int64, c > rows[-1]
    pos_offset: int = 0
    wants_logits: bool = False


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] rows whose next-token logits are wanted
    num_decode: int = 0  # rows [0, num_decode) are decode tokens
    decode_context: torch.Tensor | None = None  # [num_decode, max_len] slots, padded
    decode_bias: torch.Tensor | None = None  # [1, num_decode, 1, max_len]: 0 or -inf
    decode_lens: torch.Tensor | None = None  # [num_decode] int64 context lengths
    # the sequences of the decode rows (fewer when one verifies a draft: a row per token)
    decode_sequences: int = 0
    prefill_spans: list[PrefillSpan] = field(default_factory=list)
    windows: dict = field(default_factory=dict)  # sliding-window plans, made by window.py
    ranges: RowRanges | None = None  # every row's keys, for the native attention (CPU)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()
