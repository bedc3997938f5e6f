"""Window pages: the KV of sliding-window (local) layers in a second, smaller pool.

A model with sliding-window layers (Gemma 3: five local layers per global one) reads a local
layer's KV only for the last ``W`` tokens before the position it computes. Keeping that KV for
every cached token wastes most of the memory, so the device pool is split in two:

- the *main* pool holds the global layers' KV of every slot, as for any model;
- the *window* pool holds the local layers' KV, a page of it beside some main pages.

``WindowedAllocator`` pairs them page for page. Main page ``P`` is backed by window page
``window_page[P]``, or by none (-1: its local-layer KV was dropped; the tree calls such a
node a *tombstone*). ``window_map[slot]`` is the window slot of a main slot (the window pool's
zeroed pad slot where there is none), so attention reads a local layer at
``window_map[context]``.

Contract, beyond ``PagedAllocator``'s:
- every fresh main page comes with a fresh window page (continuing into a page's unused tail
  keeps the page's window); an allocation fails, taking nothing, when either pool is short;
- ``free`` returns both pages of each freed page;
- ``alloc_without_windows(n)``: fresh main pages without window pages (KV loaded back as a
  tombstone: the global layers only);
- ``drop_windows(slots)``: the window pages of these whole pages go back, the main pages stay;
- ``move_windows(src, dst)``: the pages of ``dst`` (without windows) take over the window
  pages of ``src`` (which then have none): a tombstone revived by KV just computed again;
- ``check`` counts every window page exactly once: free, or behind exactly one main page.
"""

from __future__ import annotations

import torch

from radixserve.cache.allocator import PagedAllocator, _require


class WindowedAllocator(PagedAllocator):
    windowed = True

    def __init__(self, num_slots: int, page_size: int, window_slots: int, window: int):
        super().__init__(num_slots, page_size)
        if window < 2:
            raise ValueError(f"a sliding window of {window} tokens: window layers need >= 2")
        self.window = window  # keys a window layer reads, the token it computes included
        self.windows = PagedAllocator(window_slots, page_size)
        self.window_slots = self.windows.num_slots
        self.window_pad = self.window_slots  # the window pool's pad slot (see ``KVPool``)
        self.window_page = torch.full((self.num_pages,), -1, dtype=torch.int64)
        # slot -> window slot; main slots without a window (and the main pad) read the pad
        self.window_map = torch.full((self.num_slots + 1,), self.window_pad, dtype=torch.int64)

    # ----------------------------------------------------------------- sizes (in tokens)
    def window_free_size(self) -> int:
        return self.windows.free_size()

    def window_start(self, resume: int) -> int:
        """Where the window before resume point ``resume`` starts, rounded down to a page:
        the first of the ``window - 1`` tokens a local layer reads before it."""
        start = max(0, resume - (self.window - 1))
        return start - start % self.page_size

    @property
    def window_span(self) -> int:
        """Slots of the window before a resume point on a page boundary (where the tree
        resumes and locks): its ``window - 1`` tokens, in whole pages."""
        return -(-(self.window - 1) // self.page_size) * self.page_size

    # ----------------------------------------------------------------- page operations
    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > self.windows.num_free_pages():
            return None
        pages = super()._take_pages(num_pages)
        if pages is not None and num_pages:
            self._pair(pages, self.windows._take_pages(num_pages))
        return pages

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        pages = self.pages_of(indices)
        super().free(indices)  # raises on a double free before anything changes
        self._unpair(pages)

    def alloc_without_windows(self, n: int) -> torch.Tensor | None:
        """``n`` slots in fresh main pages that have no window pages (None: too few free)."""
        pages = super()._take_pages(-(-n // self.page_size))
        return None if pages is None else self._pages_to_slots(pages)[:n]

    def drop_windows(self, slots: torch.Tensor) -> None:
        """Free the window pages behind these slots' pages (whole pages; each must have one)."""
        pages = self.pages_of(slots)
        _require(bool((self.window_page[pages] >= 0).all()), "dropping a window page not held")
        self._unpair(pages)

    def move_windows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Give ``dst``'s pages (none with a window) the window pages of ``src``'s."""
        src_pages, dst_pages = self.pages_of(src), self.pages_of(dst)
        _require(src_pages.numel() == dst_pages.numel(), "moving windows between unequal runs")
        windows = self.window_page[src_pages]
        _require(bool((windows >= 0).all()), "moving a window that is not there")
        _require(bool((self.window_page[dst_pages] < 0).all()), "moving onto a held window")
        self._set_map(src_pages, None)
        self.window_page[src_pages] = -1
        self._pair(dst_pages, windows)

    def has_windows(self, slots: torch.Tensor) -> torch.Tensor:
        """Per page of ``slots`` (given in runs): whether it has a window page."""
        return self.window_page[self.pages_of(slots)] >= 0

    # ----------------------------------------------------------------- bookkeeping
    def _pair(self, pages: torch.Tensor, windows: torch.Tensor) -> None:
        self.window_page[pages] = windows
        self._set_map(pages, windows)

    def _unpair(self, pages: torch.Tensor) -> None:
        windows = self.window_page[pages]
        held = windows >= 0
        if bool(held.any()):
            self.windows.free(windows[held] * self.page_size)  # one slot per page
        self.window_page[pages] = -1
        self._set_map(pages, None)

    def _set_map(self, pages: torch.Tensor, windows: torch.Tensor | None) -> None:
        offsets = self._page_offsets
        slots = (pages[:, None] * self.page_size + offsets).reshape(-1)
        if windows is None:
            self.window_map[slots] = self.window_pad
        else:
            self.window_map[slots] = (windows[:, None] * self.page_size + offsets).reshape(-1)

    def check(
        self, cached_slots: torch.Tensor | None = None, held_indices: torch.Tensor | None = None
    ) -> None:
        super().check(cached_slots, held_indices)
        self.windows.check()
        paired = self.window_page[self.window_page >= 0]
        owner = torch.zeros(self.windows.num_pages, dtype=torch.int64)
        owner[self.windows.free_pages()] += 1
        owner.index_add_(0, paired, torch.ones_like(paired))
        _require(
            bool((owner == 1).all()),
            f"window pages: {int((owner == 0).sum())} leaked, {int((owner > 1).sum())} owned twice",
        )
        _require(
            not bool((self.window_page[self.free_pages()] >= 0).any()),
            "a free page keeps a window page",
        )
