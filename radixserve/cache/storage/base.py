"""The storage tier (L3) interface: whole KV pages by key, in a file directory or in Redis.

A backend moves pages between a store and host memory. Its caller names pages by keys from
``keys.chain_page_keys`` and hands over a ``HostPages``: a batch of page buffers, the j-th
buffer for the j-th key. Contracts:

* ``exists(keys, writing=False)`` -> how many LEADING keys are stored (stops at the first
  miss); ``writing``: the lookup is the first half of a write-out, so its failure is one.
* ``get(keys, pages)`` -> how many leading pages were read whole and valid into ``pages``;
  page j < result holds the stored bytes of ``keys[j]`` (with or without window KV, as
  stored: ``HostPages.has_window``), pages from the result on are unspecified. A corrupt,
  truncated or foreign page is refused, counted and deleted.
* ``set(keys, pages)`` -> how many leading pages are now stored (a page already present
  counts, whatever it holds). It stops at the first failure: a page after a gap could never
  be matched.
* ``clear()`` deletes this scope's pages (one model and layout), nothing else in the store,
  and returns a ``ClearResult``: ``cleared`` only when none of them is left.
* ``stats()`` -> a ``StorageStats`` snapshot.

Failures of the store (disk full, read-only directory, Redis down or gone mid-call, a page
file that another process deleted) never raise out of these calls: they return a short
count (or a ``ClearResult`` saying why not) and log a rate-limited warning. Each failed call
is one error in ``stats()``, of the kind of the work that failed (a read or a write; a clear
is a write), calls refused at once while a store is known to be down included. Wrong
arguments from the caller (a batch shorter than its keys, a page of the wrong size) are
programming errors and raise ``ValueError``.

Thread safety: several reader threads (exists/get) and one writer thread (set/clear) may
call a backend concurrently.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from radixserve.cache.storage.keys import StorageScope
from radixserve.cache.storage.page_format import PageLayout, stored_layers


@runtime_checkable
class HostPages(Protocol):
    """A batch of page buffers in host memory; the host pool implements it.

    Each page holds ``page_nbytes`` bytes in the layout of ``page_format`` (layer-major
    ``[num_layers, 2, num_kv_heads, page_size, head_dim]`` in the KV dtype). A page of a
    model with sliding-window layers may lack their KV (``has_window`` False): it is stored,
    and read back, with its global layers only.
    """

    page_nbytes: int

    def __len__(self) -> int: ...

    def has_window(self, i: int) -> bool:
        """Whether page i holds the window layers' KV (always, for a model without them)."""
        ...

    def read_page(self, i: int) -> memoryview:
        """Page i's payload as it is stored, C-contiguous: every layer, or the global ones
        where ``has_window(i)`` is False (a view is best: the backend copies it once)."""
        ...

    def write_page(self, i: int, data: memoryview, window: bool = True) -> None:
        """Store ``data`` as page i: every layer's KV (``page_nbytes`` bytes), or (``window``
        False) the global layers' only; ``has_window(i)`` says which from then on."""
        ...


class TensorPages:
    """``HostPages`` over a CPU tensor ``[num_pages, num_layers, 2, kv_heads, page_size,
    head_dim]``: the reference implementation, used by tests and the benchmark.
    ``window_layers``: the model's sliding-window layers; ``windows``: per page, whether it
    holds their KV (default: every page does)."""

    def __init__(self, tensor: torch.Tensor, window_layers: tuple[int, ...] = (),
                 windows: list[bool] | None = None):  # fmt: skip
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dim() != 6:
            raise ValueError("TensorPages needs a contiguous 6-D CPU tensor")
        self.tensor = tensor
        self._bytes = tensor.view(tensor.shape[0], tensor.shape[1], -1).view(torch.uint8).numpy()
        self.page_nbytes = self._bytes[0].size
        self.window_layers = window_layers
        self.windows = [True] * len(tensor) if windows is None else list(windows)

    @classmethod
    def empty(cls, layout: PageLayout, num_pages: int) -> TensorPages:
        shape = (num_pages, *layout.page_shape)
        return cls(torch.zeros(shape, dtype=layout.torch_dtype), layout.window_layers)

    def __len__(self) -> int:
        return self._bytes.shape[0]

    def has_window(self, i: int) -> bool:
        return self.windows[i]

    def read_page(self, i: int) -> memoryview:
        if self.windows[i]:
            return memoryview(self._bytes[i]).cast("B")
        layers = stored_layers(len(self._bytes[i]), self.window_layers, False)
        return memoryview(np.ascontiguousarray(self._bytes[i][layers])).cast("B")

    def write_page(self, i: int, data: memoryview, window: bool = True) -> None:
        page = self._bytes[i]
        layers = stored_layers(len(page), self.window_layers, window)
        page[layers] = np.frombuffer(data, dtype=np.uint8).reshape(-1, page.shape[1])
        self.windows[i] = window


@dataclass(frozen=True)
class ClearResult:
    """What ``clear`` did: ``cleared`` when none of the scope's pages is left, else why not."""

    cleared: bool
    reason: str | None = None


@dataclass
class StorageStats:
    """A snapshot of one backend: monotonic counters and what it holds now."""

    backend: str  # "file" or "redis"
    capacity_bytes: int | None  # None: unbounded here (Redis: the server's maxmemory rules)
    used_bytes: int | None  # None where the backend cannot know cheaply (Redis)
    stored_pages: int | None
    pages_read: int = 0
    bytes_read: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    exists_queries: int = 0  # keys asked about
    exists_hits: int = 0  # leading keys found
    get_misses: int = 0  # get calls stopped by a page that was not there
    corrupt_pages: int = 0  # refused on read (and deleted)
    read_errors: int = 0  # reads that failed (I/O, connection, the store known down)
    write_errors: int = 0  # writes and clears that failed (disk full, read-only, down, ...)
    evicted_pages: int = 0  # deleted to keep under the size cap


class StorageBackend(ABC):
    """See the module docstring for the contract of each call."""

    name = "storage"

    def __init__(self, scope: StorageScope):
        self.scope = scope
        self.layout = scope.layout
        self._stats = StorageStats(self.name, None, None, None)
        self._stats_lock = threading.Lock()
        self._warn = RateLimitedWarning(logging.getLogger(type(self).__module__))

    @abstractmethod
    def exists(self, keys: Sequence[bytes], writing: bool = False) -> int: ...

    @abstractmethod
    def get(self, keys: Sequence[bytes], pages: HostPages) -> int: ...

    @abstractmethod
    def set(self, keys: Sequence[bytes], pages: HostPages) -> int: ...

    @abstractmethod
    def clear(self) -> ClearResult: ...

    @abstractmethod
    def stats(self) -> StorageStats: ...

    def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing open)
        """Release connections or handles; the default has none."""

    def _check_batch(self, keys: Sequence[bytes], pages: HostPages) -> None:
        if len(pages) < len(keys):
            raise ValueError(f"{len(keys)} keys but only {len(pages)} host pages")
        if pages.page_nbytes != self.layout.page_nbytes:
            raise ValueError(
                f"host pages of {pages.page_nbytes} bytes, this store's layout needs "
                f"{self.layout.page_nbytes} ({self.layout.descriptor})"
            )

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _snapshot(self, **now) -> StorageStats:
        with self._stats_lock:
            return StorageStats(**{**self._stats.__dict__, **now})


class RateLimitedWarning:
    """Logs a warning of each kind at most once per ``interval`` seconds, with a count of the
    ones held back, so a store that is down for an hour does not flood the log."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0):
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            held = self._held.pop(kind, 0)
            self._last[kind] = now
        suffix = f" ({held} similar warnings held back)" if held else ""
        self.logger.warning("%s%s", message, suffix)
