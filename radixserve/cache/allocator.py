"""The slot allocator: sole owner of the free pages of the KV pool.

A *slot* holds the K and V of one token in every layer; slots are grouped in pages of
``page_size`` consecutive slots, and slot ``s`` lives in page ``s // page_size``. The allocator
hands out and takes back whole pages; a request may use a page partially (its last one), and
``alloc_extend`` / ``alloc_decode`` continue a request into the unused tail of its last page
before taking new pages.

Contract:
- ``alloc(n)`` returns ``n`` slot indices (int64, filling ``ceil(n / page_size)`` fresh pages
  from their first slot) or ``None`` when too few pages are free; nothing is taken then.
- ``free(indices)`` returns the pages these slots belong to. Indices must come in the runs the
  allocator handed out (all slots of one page adjacent); freeing a page twice raises.
- Both are O(pages moved), never O(capacity): the free pages live in a preallocated stack.
"""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    """Raised where a caller asked for slots that the pool cannot give even after eviction."""


class PagedAllocator:
    windowed = False  # pages of sliding-window layers beside each page (``window_pages.py``)

    def __init__(self, num_slots: int, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < page_size:
            raise ValueError(f"num_slots ({num_slots}) must hold at least one page of {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        # Free pages form a stack: _stack[:_top] are free. Popping from the top is O(k).
        self._stack = torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int64)
        self._top = self.num_pages
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self._seen = torch.zeros(self.num_pages, dtype=torch.int32)  # free()'s duplicate count

    # ----------------------------------------------------------------- sizes (in tokens)
    def free_size(self) -> int:
        return self._top * self.page_size

    def num_free_pages(self) -> int:
        return self._top

    # ----------------------------------------------------------------- page operations
    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > self._top:
            return None
        pages = self._stack[self._top - num_pages : self._top].clone()
        self._top -= num_pages
        self._is_free[pages] = False
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        pages = self._take_pages(-(-n // self.page_size))
        if pages is None:
            return None
        return self._pages_to_slots(pages)[:n]

    def alloc_extend(self, last_slot: int | None, n: int) -> torch.Tensor | None:
        """``n`` slots continuing a sequence whose last slot is ``last_slot`` (None: no slot yet).

        The unused tail of ``last_slot``'s page is used first, then fresh pages.
        """
        if last_slot is None or self.page_size == 1:
            return self.alloc(n)
        room = self.page_size - 1 - (last_slot % self.page_size)
        in_page = torch.arange(last_slot + 1, last_slot + 1 + min(room, n), dtype=torch.int64)
        if n <= room:
            return in_page
        fresh = self.alloc(n - room)
        if fresh is None:
            return None
        return torch.cat([in_page, fresh])

    def alloc_decode(self, last_slots: torch.Tensor) -> torch.Tensor | None:
        """One new slot for each of several sequences, given each one's last slot."""
        if self.page_size == 1:
            return self.alloc(len(last_slots))
        needs_page = (last_slots % self.page_size) == self.page_size - 1
        pages = self._take_pages(int(needs_page.sum()))
        if pages is None:
            return None
        out = last_slots + 1
        out[needs_page] = pages * self.page_size
        return out

    def pages_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The pages of ``indices`` given in runs (each page once, in order)."""
        if self.page_size == 1:
            return indices
        return torch.unique_consecutive(indices // self.page_size)

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        pages = self.pages_of(indices)
        k = pages.numel()
        if bool(self._is_free[pages].any()) or (k > 1 and self._listed_twice(pages)):
            raise RuntimeError("double free: a page is already free or listed twice")
        self._is_free[pages] = True
        self._stack[self._top : self._top + k] = pages
        self._top += k

    def _listed_twice(self, pages: torch.Tensor) -> bool:
        # counts in a scratch array, O(pages) (a sort, as unique does, is O(k log k) and
        # dominated the eviction of long prefixes)
        self._seen.index_put_((pages,), torch.ones(len(pages), dtype=torch.int32), accumulate=True)
        twice = bool((self._seen[pages] > 1).any())
        self._seen[pages] = 0
        return twice

    # ----------------------------------------------------------------- for integrity checks
    def free_pages(self) -> torch.Tensor:
        return self._stack[: self._top]

    def check(
        self, cached_slots: torch.Tensor | None = None, held_indices: torch.Tensor | None = None
    ) -> None:
        """Raise AssertionError unless every page is in exactly one place.

        ``cached_slots``: the slots a prefix cache owns (whole pages); ``held_indices``: every
        slot held by running requests. With both, free + cached + held must be the capacity.
        """
        free = self.free_pages()
        _require(torch.unique(free).numel() == free.numel(), "a page is on the free stack twice")
        _require(int(self._is_free.sum()) == self._top, "free flags disagree with the free stack")
        owner = torch.zeros(self.num_pages, dtype=torch.int64)
        owner[free] += 1
        if cached_slots is not None and cached_slots.numel():
            owner[cached_slots[:: self.page_size] // self.page_size] += 1
            _require(int(owner.max()) <= 1, "a cached page is also on the free stack")
        if held_indices is not None:
            owner[torch.unique(held_indices.to(torch.int64) // self.page_size)] += 1
            _require(
                bool((owner == 1).all()),
                f"free + cached + held != capacity: {int((owner == 0).sum())} pages leaked, "
                f"{int((owner > 1).sum())} pages owned twice",
            )


def _require(condition: object, message: str) -> None:
    if not condition:
        raise AssertionError(message)
