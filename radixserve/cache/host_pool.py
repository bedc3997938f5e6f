"""HostKVPool: the host tier (L2), a second KV pool in host memory with its own allocator.

Layout is page-first, ``data[page] = [num_layers, 2 (K, V), num_kv_heads, page_size,
row_width]``, rows in the tier's ``KVFormat`` (``kv_format.py``): the device pool's, or int8
below a float device pool (``--kv-tier-dtype int8``: pages encoded as they leave the device,
decoded as they come back); below an int8 pool with float layers, int8 for every layer
(``KVPool.layer_rows``). One page of every layer is one contiguous buffer: what a storage backend
reads and writes whole, without a gather. Copies to and from the device pool go by slot
indices (whole pages on both sides):

- ``backup(device_slots, host_slots)``: device -> host. Synchronous: the caller may free the
  device slots as soon as it returns.
- ``restore(host_slots, device_slots)``: host -> device. On CPU a plain copy. On CUDA the
  pages are staged in pinned memory and copied on a side stream, one event per layer; the
  device pool's ``write`` for a layer waits for that layer's event (``KVPool.wait_layer``), so
  the forward pass computes early layers while later ones are still copying.

Ownership: the allocator owns free host pages, the tree owns the host pages of its nodes, and
whatever reads or writes pages on another thread (storage I/O) marks them busy: ``free`` of a
busy page is deferred until ``io_end``, so a page is never reused under a running read or
write. ``check`` verifies ``free + cached + held == capacity`` with deferred pages counted as
held.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.cache.allocator import PagedAllocator
from radixserve.cache.kv_format import KVFormat
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.storage.page_format import stored_layers


@dataclass
class TransferStats:
    """Monotonic counters of pages and bytes moved, per direction."""

    pages_to_host: int = 0
    bytes_to_host: int = 0
    pages_to_device: int = 0
    bytes_to_device: int = 0


class HostKVPool:
    def __init__(self, device_pool: KVPool, num_slots: int, page_size: int,
                 kv_format: KVFormat | None = None):  # fmt: skip
        """``kv_format``: how the pages store KV; default: as the device pool does."""
        shape = device_pool.shape
        self.format = kv_format or device_pool.format
        if self.format != device_pool.format and not self.format.quantized:
            raise ValueError(f"a host tier of {self.format.name} below a {device_pool.format.name} "
                             "device pool: only int8 pages below a float pool")  # fmt: skip
        self.format.check_dim(shape.head_dim)
        self.device_pool = device_pool
        self.allocator = PagedAllocator(num_slots, page_size)
        self.page_size = page_size
        self.num_slots = self.allocator.num_slots
        cuda = device_pool.device.type == "cuda"
        size = (self.allocator.num_pages, shape.num_layers, 2, shape.num_kv_heads, page_size,
                self.format.row_width(shape.head_dim))  # fmt: skip
        self.data = torch.empty(size, dtype=self.format.storage_dtype, pin_memory=cuda)
        self.raw = self.data.view(torch.uint8).numpy()  # the same memory as bytes, for I/O
        self.page_nbytes = self.data[0].numel() * self.data.element_size()
        self._stored_layers = {w: stored_layers(shape.num_layers, shape.window_layers, w)
                               for w in (True, False)}  # fmt: skip
        self._stream = torch.cuda.Stream(device_pool.device) if cuda else None
        self._stage = torch.empty(0, dtype=self.format.storage_dtype, pin_memory=cuda)
        self.stats = TransferStats()
        self._lock = threading.Lock()  # guards the busy and deferred pages (I/O threads)
        self._busy: Counter[int] = Counter()
        self._deferred: set[int] = set()

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    # ------------------------------------------------------------------ slots
    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` (whole pages); pages under I/O go back when their I/O ends."""
        if slots.numel() == 0:
            return
        pages = self.pages_of(slots)
        with self._lock:
            busy = [p for p in pages.tolist() if self._busy[p]]
            if busy:
                self._deferred.update(busy)
                pages = pages[~torch.isin(pages, torch.tensor(busy))]
        self.allocator.free(self.slots_of(pages))

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        return slots[:: self.page_size] // self.page_size

    def slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def io_begin(self, pages: list[int]) -> None:
        with self._lock:
            self._busy.update(pages)

    def io_end(self, pages: list[int]) -> None:
        """Called from the main thread once an I/O on ``pages`` finished."""
        done = []
        with self._lock:
            for p in pages:
                self._busy[p] -= 1
                if self._busy[p] == 0:
                    del self._busy[p]
                    if p in self._deferred:
                        self._deferred.discard(p)
                        done.append(p)
        if done:
            self.allocator.free(self.slots_of(torch.tensor(done, dtype=torch.int64)))

    def deferred_slots(self) -> torch.Tensor:
        with self._lock:
            pages = torch.tensor(sorted(self._deferred), dtype=torch.int64)
        return self.slots_of(pages)

    # ------------------------------------------------------------------ page buffers
    def page_buffer(self, page: int) -> memoryview:
        """One page's bytes (every layer's K and V), a view: storage reads and writes it."""
        return memoryview(self.raw[page]).cast("B")

    def pages(self, pages: list[int], per_block: int = 1,
              windows: list[bool] | None = None) -> BlockBatch:  # fmt: skip
        """Host pages as a storage backend reads and writes them: one stored block per
        ``per_block`` consecutive pages; ``windows``: per block, whether it has the window
        layers' KV (``BlockBatch``)."""
        return BlockBatch(self, pages, per_block, windows)

    def stored_layers(self, window: bool) -> slice | np.ndarray:
        """The layers of a page that a stored block holds: every one, or the global ones."""
        return self._stored_layers[window]

    # ------------------------------------------------------------------ copies
    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the KV of ``device_slots`` into ``host_slots`` (same length, whole pages): one
        gather over every layer, not one per layer (a copy costs a few tensor operations)."""
        pool, ps = self.device_pool, self.page_size
        pages = self.pages_of(host_slots)
        n = len(pages)
        if self._stream is not None:  # the slots may be the target of a load still running
            torch.cuda.current_stream(pool.device).wait_stream(self._stream)
        dev_slots = device_slots.to(pool.device, non_blocking=True)
        kv = self._gather(dev_slots)  # [layers, 2, heads, n * ps, dim]
        kv = self._to_host_format(kv)
        layers, _, heads, _, dim = kv.shape
        kv = kv.view(layers, 2, heads, n, ps, dim).permute(3, 0, 1, 2, 4, 5)
        self.data[pages] = kv.to("cpu")  # a synchronous copy on CUDA
        self.stats.pages_to_host += n
        self.stats.bytes_to_host += n * self.page_nbytes

    def restore(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
                windows_from: int = 0) -> None:  # fmt: skip
        """Copy the KV of ``host_slots`` into ``device_slots`` (same length, whole pages); with
        the window layers apart, theirs only into ``device_slots[windows_from:]`` (the slots
        before have no window pages: they are loaded as tombstones)."""
        ps = self.page_size
        pages = self.pages_of(host_slots)
        n = len(pages)
        if self._stream is None:  # one scatter over every layer
            kv = self.data[pages].permute(1, 2, 3, 0, 4, 5)  # [layers, 2, heads, n, ps, dim]
            kv = kv.reshape(*kv.shape[:3], n * ps, kv.shape[-1])
            self._scatter(kv, device_slots, windows_from)
        elif windows_from:
            raise ValueError("a load without window KV on a GPU: window layers are not apart")
        else:
            self._restore_async(pages, device_slots, n, ps)
        self.stats.pages_to_device += n
        self.stats.bytes_to_device += n * self.page_nbytes

    def _to_host_format(self, kv: torch.Tensor) -> torch.Tensor:
        """Rows ``[layers, 2, heads, n, row]`` of every layer in the device pool's format as
        this tier stores them."""
        if self.format == self.device_pool.format:
            return kv
        # a float device pool: its values, encoded (keys in the format's key order)
        return torch.stack([self.format.encode(kv[:, 0], keys_of=slice(None)),
                            self.format.encode(kv[:, 1])], 1)  # fmt: skip

    def _to_device_format(self, kv: torch.Tensor, layers: slice = slice(None)) -> torch.Tensor:
        """Rows ``[layers, 2, heads, n, row]`` of ``layers`` as this tier stores them in the
        device pool's format."""
        if self.format == self.device_pool.format:
            return kv
        shape = self.device_pool.shape
        k = self.format.decode(kv[:, 0], shape.head_dim, shape.dtype, layers)
        return torch.stack([k, self.format.decode(kv[:, 1], shape.head_dim, shape.dtype)], 1)

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V of ``slots``, in the model's layer order: one gather per
        pool (the window layers' pool, when apart, through the window map)."""
        pool = self.device_pool
        layers = pool.shape.num_layers if pool.has_float_layers else len(pool.k)
        kv = torch.stack([pool.layer_rows(i, 0, layers, slots) for i in (0, 1)], dim=1)
        if not pool.windowed:
            return kv
        window_slots = pool.to_window(slots)
        wkv = torch.stack([pool.wk.index_select(2, window_slots),
                           pool.wv.index_select(2, window_slots)], dim=1)  # fmt: skip
        out = kv.new_empty((len(pool.groups), *kv.shape[1:]))
        out[pool.main_layers], out[pool.window_layers] = kv, wkv
        return out

    def _scatter(self, kv: torch.Tensor, slots: torch.Tensor, windows_from: int = 0) -> None:
        """Write ``kv`` [layers, 2, heads, n, dim] into the pool at ``slots`` (the window
        layers at the window slots of ``slots[windows_from:]``, which have them)."""
        pool = self.device_pool
        kv = self._to_device_format(kv)
        if not pool.windowed:
            for i in (0, 1):
                pool.put_layer_rows(i, 0, len(kv), slots, kv[:, i])
            return
        pool.k.index_copy_(2, slots, kv[pool.main_layers, 0])
        pool.v.index_copy_(2, slots, kv[pool.main_layers, 1])
        window_slots = pool.to_window(slots[windows_from:])
        window_kv = kv[pool.window_layers][:, :, :, windows_from:]
        pool.wk.index_copy_(2, window_slots, window_kv[:, 0])
        pool.wv.index_copy_(2, window_slots, window_kv[:, 1])

    def _restore_layer(
        self, kv: torch.Tensor, device_slots: torch.Tensor, layer: int, n: int, ps: int
    ) -> None:
        """``kv``: [n, 2, heads, ps, dim] on the device's side; scatter it into the pool."""
        pool = self.device_pool
        heads = pool.shape.num_kv_heads
        kv = kv.permute(1, 2, 0, 3, 4).reshape(2, heads, n * ps, kv.shape[-1])
        kv = self._to_device_format(kv[None], slice(layer, layer + 1))[0]
        for i in (0, 1):
            pool.put_layer_rows(i, layer, layer + 1, device_slots, kv[i : i + 1])

    def _restore_async(self, pages: torch.Tensor, device_slots: torch.Tensor, n: int, ps: int):
        pool = self.device_pool
        layers = pool.shape.num_layers
        # The staging buffer is reused: wait until the previous load has read it.
        self._stream.synchronize()
        need = n * self.data[0].numel()
        if self._stage.numel() < need:
            self._stage = torch.empty(need, dtype=self.data.dtype, pin_memory=True)
        stage = self._stage[:need].view(n, *self.data.shape[1:])
        torch.index_select(self.data, 0, pages, out=stage)
        events = []
        main = torch.cuda.current_stream(pool.device)
        self._stream.wait_stream(main)  # the slots were allocated by work queued on main
        with torch.cuda.stream(self._stream):
            dev_slots = device_slots.to(pool.device, non_blocking=True)
            for layer in range(layers):
                kv = stage[:, layer].to(pool.device, non_blocking=True)
                self._restore_layer(kv, dev_slots, layer, n, ps)
                event = torch.cuda.Event()
                event.record(self._stream)
                events.append(event)
        pool.wait_for_layers(events)

    # ------------------------------------------------------------------ integrity
    def check(self, cached_slots: torch.Tensor, held_slots: torch.Tensor | None = None) -> None:
        """free + cached (tree) + held (I/O, deferred frees) == capacity, page by page."""
        held = [self.deferred_slots()]
        if held_slots is not None:
            held.append(held_slots)
        self.allocator.check(cached_slots, torch.cat(held))


class BlockBatch:
    """Host pages grouped into storage blocks (``storage.base.HostPages``): block j is pages
    ``pages[j * k : (j + 1) * k]``, its tokens theirs in order, its payload in the layer-major
    layout of a page of ``k * page_size`` tokens (``page_format``). So a block is the same
    bytes whatever the host page size that wrote it. ``windows``: per block, whether it holds
    the window layers' KV (False: it is stored with the global layers only; default: every
    block has it); reading a block back sets its flag as stored.

    A block of one page with every layer is read in place; any other read or write copies,
    with numpy: storage I/O threads call these, and a torch operation there would start a
    second OpenMP team beside the forward pass's, which then wakes its workers from sleep at
    every operation (twice the time per step on two cores, far more on a busy machine)."""

    def __init__(self, pool: HostKVPool, pages: list[int], per_block: int,
                 windows: list[bool] | None = None):  # fmt: skip
        if len(pages) % per_block:
            raise ValueError(f"{len(pages)} pages do not make whole blocks of {per_block}")
        self.pool, self.page_ids, self.per_block = pool, pages, per_block
        self.page_nbytes = pool.page_nbytes * per_block
        self.windows = [True] * len(self) if windows is None else list(windows)
        if len(self.windows) != len(self):
            raise ValueError(f"{len(self.windows)} window flags for {len(self)} blocks")

    def __len__(self) -> int:
        return len(self.page_ids) // self.per_block

    def _ids(self, i: int) -> list[int]:
        k = self.per_block
        return self.page_ids[i * k : (i + 1) * k]

    def has_window(self, i: int) -> bool:
        return self.windows[i]

    def read_page(self, i: int) -> memoryview:
        ids, window = self._ids(i), self.windows[i]
        if self.per_block == 1 and window:
            return self.pool.page_buffer(ids[0])
        block = self.pool.raw[ids][:, self.pool.stored_layers(window)]  # [k, layers, ...]
        block = np.ascontiguousarray(block.transpose(1, 2, 3, 0, 4, 5))  # k pages: one page
        return memoryview(block).cast("B")

    def write_page(self, i: int, data: memoryview, window: bool = True) -> None:
        _, _, two, heads, page, row = self.pool.raw.shape
        raw = np.frombuffer(data, dtype=np.uint8)
        block = raw.reshape(-1, two, heads, self.per_block, page, row).transpose(3, 0, 1, 2, 4, 5)
        ids = self._ids(i)
        if window:
            self.pool.raw[ids] = block
        else:  # the window layers' rows are left as they were: nothing reads them
            self.pool.raw[np.ix_(ids, self.pool.stored_layers(False))] = block
        self.windows[i] = window
