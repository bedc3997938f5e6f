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
    """``k[layer]`` and ``v[layer]`` are ``[num_kv_heads, num_slots + 1, head_dim]``.

    Head-major, so a gather of any slots is already ``[heads, n, dim]``, the layout attention
    wants, without a transpose copy. ``gather`` fills reusable scratch buffers: its result is
    valid until the next ``gather`` call (attention uses each one at once).
    """

    def __init__(self, shape: KVShape, num_slots: int, device: str | torch.device = "cpu"):
        if num_slots <= 0:
            raise ValueError(f"the KV pool needs at least one slot, got {num_slots}")
        self.shape = shape
        self.num_slots = num_slots
        self.device = torch.device(device)
        # One extra, zeroed slot: the padding that batched decode reads for positions it
        # masks out. Every other slot is written before it is read, so it starts uninitialised
        # (zeroing gigabytes would take seconds at start-up).
        self.pad_slot = num_slots
        size = (shape.num_layers, shape.num_kv_heads, num_slots + 1, shape.head_dim)
        self.k = torch.empty(size, dtype=shape.dtype, device=self.device)
        self.v = torch.empty(size, dtype=shape.dtype, device=self.device)
        self.k[:, :, self.pad_slot].zero_()
        self.v[:, :, self.pad_slot].zero_()
        self._scratch = torch.empty(0, dtype=shape.dtype, device=self.device)
        self._layer_events: list | None = None  # CUDA: a load from the host tier in flight

    def wait_for_layers(self, events: list) -> None:
        """Make the next forward pass wait, layer by layer, for a copy into the pool (one
        CUDA event per layer, recorded on the copy's stream)."""
        self._layer_events = events

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V given as ``[n, num_kv_heads, head_dim]`` into ``slots`` of one layer.
        The forward pass calls it first for every layer, before reading the layer's KV."""
        if self._layer_events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer])
            if layer == len(self._layer_events) - 1:
                self._layer_events = None
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` (1-D) as ``[num_kv_heads, n, head_dim]`` scratch views."""
        heads, n, dim = self.shape.num_kv_heads, slots.numel(), self.shape.head_dim
        need = 2 * heads * n * dim
        if self._scratch.numel() < need:  # grow-only: allocation (and page faults) once
            self._scratch = torch.empty(max(need, 2 * self._scratch.numel()),
                                        dtype=self.shape.dtype, device=self.device)  # fmt: skip
        k = self._scratch[: need // 2].view(heads, n, dim)
        v = self._scratch[need // 2 : need].view(heads, n, dim)
        torch.index_select(self.k[layer], 1, slots, out=k)
        torch.index_select(self.v[layer], 1, slots, out=v)
        return k, v

    def nbytes(self) -> int:
        return self.num_slots * self.shape.bytes_per_token()
