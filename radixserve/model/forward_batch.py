"""The packed batch a forward step runs: where each new token's K/V goes and what it reads.

``ForwardBatch`` is made by ``attention.build_forward_batch`` and read by the models and by
the attention functions; ``PrefillSpan``, ``SparsePrefill`` and ``SparseGroup`` describe its
prefill chunks (see ``attention.py`` for how each kind is attended). Plain data, no logic, so
every module of the model package can name these types without importing the attention code.
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


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the packed batch
    num_new: int
    prefix_len: int  # tokens before this chunk whose K/V is already in the pool
    context_slots: torch.Tensor | None = None  # [prefix_len + num_new] when prefix_len > 0
    mask: torch.Tensor | None = None  # [num_new, prefix_len + num_new] bool
    groups: list[SparseGroup] | None = None  # a sparse prefill's rows, attended per group


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

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()
