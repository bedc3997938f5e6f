"""SimHostPool: the host tier (L2) of a simulated instance, its slots without their KV.

The simulator runs the server's own radix tree and ``TierController`` (which node is copied
when, what a match loads back, what the host tier evicts); only the pool they copy into is
this stand-in. It keeps what the controller reads of a ``HostKVPool``: a paged
allocator of ``num_slots`` slots, the page size, the bytes a page would take
(``page_nbytes``, for the tier statistics) and the transfer counters. ``backup`` and
``restore`` move no bytes: they count pages, and the simulated instance turns the pages
moved during a step into time with the timing model's per-token costs
(``TimingModel.host_load_token``, ``host_write_token``).

There is no storage tier below it (nothing reads or writes page buffers), so no page is
ever busy under I/O and ``free`` returns pages at once.
"""

from __future__ import annotations

import torch

from radixserve.cache import PagedAllocator
from radixserve.cache.host_pool import TransferStats


class SimHostPool:
    def __init__(self, num_slots: int, page_size: int, bytes_per_token: int):
        self.allocator = PagedAllocator(num_slots, page_size)
        self.page_size = page_size
        self.num_slots = self.allocator.num_slots
        self.page_nbytes = bytes_per_token * page_size
        self.stats = TransferStats()

    def nbytes(self) -> int:
        return self.allocator.num_pages * self.page_nbytes

    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.allocator.free(slots)

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        pages = len(host_slots) // self.page_size
        self.stats.pages_to_host += pages
        self.stats.bytes_to_host += pages * self.page_nbytes

    def restore(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
                windows_from: int = 0) -> None:  # fmt: skip
        pages = len(host_slots) // self.page_size
        self.stats.pages_to_device += pages
        self.stats.bytes_to_device += pages * self.page_nbytes

    def check(self, cached_slots: torch.Tensor, held_slots: torch.Tensor | None = None) -> None:
        """free + cached (tree) == capacity, page by page (nothing is held by I/O here)."""
        held = held_slots if held_slots is not None else torch.zeros(0, dtype=torch.int64)
        self.allocator.check(cached_slots, held)
