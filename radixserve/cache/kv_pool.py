"""The KV pool: preallocated K and V tensors for every layer, indexed by token slot.

``k[layer]`` and ``v[layer]`` have shape ``[num_slots, num_kv_heads, head_dim]``. The pool only
stores; which slots are free, cached or held is the business of the allocator, the radix tree
and the requests. Size it by a token count or by a memory budget (``slots_for_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def slots_for_memory(self, num_bytes: int, page_size: int = 1) -> int:
        """How many slots (whole pages) a budget of ``num_bytes`` holds."""
        if num_bytes <= 0:
            raise ValueError(f"KV cache memory budget must be positive, got {num_bytes} bytes")
        slots = num_bytes // self.bytes_per_token()
        return slots // page_size * page_size


class KVPool:
    def __init__(self, shape: KVShape, num_slots: int, device: str | torch.device = "cpu"):
        if num_slots <= 0:
            raise ValueError(f"the KV pool needs at least one slot, got {num_slots}")
        self.shape = shape
        self.num_slots = num_slots
        self.device = torch.device(device)
        # One extra, zeroed row: the padding slot that batched decode reads for positions it
        # masks out. Every other slot is written before it is read, so it starts uninitialised
        # (zeroing gigabytes would take seconds at start-up).
        self.pad_slot = num_slots
        size = (shape.num_layers, num_slots + 1, shape.num_kv_heads, shape.head_dim)
        self.k = torch.empty(size, dtype=shape.dtype, device=self.device)
        self.v = torch.empty(size, dtype=shape.dtype, device=self.device)
        self.k[:, self.pad_slot].zero_()
        self.v[:, self.pad_slot].zero_()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of shape ``[n, num_kv_heads, head_dim]`` into ``slots`` of one layer."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def nbytes(self) -> int:
        return self.num_slots * self.shape.bytes_per_token()
