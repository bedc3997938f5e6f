"""StorageTier: the storage tier (L3) below a TieredRadixCache, reached through host pages.

Threads: the tree and both pools belong to the main (step) thread. Two worker threads make
every backend call: a reader (``exists`` lookups and ``get`` fetches, for prefetches) and a
writer (``set`` write-outs and ``clear``), each with its own queue; both post results to one
queue that the main thread applies in ``poll``. Host pages a worker reads or writes are busy
in the host pool meanwhile (freeing one defers until ``io_end``), and the pages allocated
for a fetch are held by its ``Prefetch`` until ``poll`` hands them to the tree.

- Write-out: every page copied to the host tier is then written to storage, keys chained
  from the root (``TieredRadixCache._storage_keys``); with more than ``max_pending_pages``
  waiting, a write-out is skipped and counted: a step never waits for storage.
- Prefetch: ``start_prefetch`` peeks the tree for a waiting request and, when at least
  ``min_tokens`` of its prompt lie beyond the cached prefix, asks the reader how many of
  those pages storage holds; ``poll`` allocates host pages for them and asks the reader to
  fetch them, then hangs what arrived below the cached prefix (``attach_host``). The
  scheduler admits the request once its ``Prefetch`` is done, or after ``timeout`` seconds
  (then it computes those pages; a fetch that lands later still fills the tree).
- Failures: a backend returns short counts (and logs) when its store fails; a short count
  is a miss, so the tokens are computed. An exception from a backend is a bug: logged, and
  treated the same way, so the engine goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixserve.cache.base import EMPTY_INDICES, TokenIds, as_token_array
from radixserve.cache.storage import (
    ClearResult,
    PageLayout,
    StorageBackend,
    StorageScope,
    chain_page_keys,
    open_backend,
)
from radixserve.cache.tier_stats import TierStats

log = logging.getLogger("radixserve")
CLOSE_DRAIN_SECONDS = 60.0  # at shutdown, how long pending write-outs may take to finish


@dataclass
class Prefetch:
    """One waiting request's fetch from storage; the scheduler polls ``done``."""

    tier: StorageTier
    token_ids: np.ndarray
    extra_key: Any
    start: int  # tokens cached (device or host) when it began: the fetch starts there
    keys: list[bytes]  # keys of the pages from ``start`` on
    started: float = field(default_factory=time.monotonic)
    host_slots: torch.Tensor | None = None  # held while the fetch runs
    fetched: tuple[int, int] = (0, 0)  # token range this fetch added to the tree
    done: bool = False
    timed_out: bool = False

    def expired(self, now: float) -> bool:
        return not self.done and now - self.started > self.tier.timeout

    def give_up(self) -> None:
        """The request stops waiting (it computes instead); the fetch may still land."""
        if not self.timed_out:
            self.timed_out = True
            self.tier.stats.prefetch_timeouts += 1

    def tokens_from_storage(self, lo: int, hi: int) -> int:
        """How many of the tokens ``[lo, hi)`` this fetch brought."""
        return max(0, min(hi, self.fetched[1]) - max(lo, self.fetched[0]))


class StorageTier:
    def __init__(self, cache: Any, backend: StorageBackend, scope: StorageScope, url: str,
                 min_tokens: int, timeout: float, max_pending_pages: int):  # fmt: skip
        self.cache, self.host, self.backend, self.scope = cache, cache.host, backend, scope
        self.page_size = cache.page_size
        self.min_tokens, self.timeout = max(min_tokens, self.page_size), timeout
        self.max_pending_pages = max_pending_pages
        self.stats = cache.tiers
        self.stats.storage_url = url
        self._pending_pages = 0
        self._reads_out = 0  # reader jobs not answered yet
        self._last_read = time.monotonic()  # when the reader last answered (or went idle)
        self._held: dict[int, torch.Tensor] = {}  # id(prefetch) -> host slots being fetched
        self._cleared = ClearResult(False)  # what the last clear did
        self._results: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(
                target=self._work, args=(q,), name=f"radixserve-storage-{name}", daemon=True
            )  # fmt: skip
            for q, name in ((self._reads, "reader"), (self._writes, "writer"))
        ]
        for t in self._threads:
            t.start()

    def page_keys(self, namespace: Any, tokens: np.ndarray, parent: bytes | None) -> list[bytes]:
        return chain_page_keys(self.scope, parent, tokens, namespace)

    # ------------------------------------------------------------------ main thread
    def write(self, keys: list[bytes], host_slots: torch.Tensor,
              on_done: Callable[[int], None] | None = None) -> None:  # fmt: skip
        """Write these host pages out, asynchronously; ``on_done(pages written)`` in poll."""
        pages = self.host.pages_of(host_slots).tolist()
        if self._pending_pages + len(pages) > self.max_pending_pages:
            self.stats.storage_write_skipped_pages += len(pages)
            return
        self._pending_pages += len(pages)
        self.host.io_begin(pages)
        self._writes.put(("write", keys, pages, on_done))

    def start_prefetch(self, token_ids: TokenIds, extra_key: Any = None) -> Prefetch | None:
        key = as_token_array(token_ids)
        start = self.cache.peek_prefix(key, extra_key).length
        end = len(key) - len(key) % self.page_size
        if end - start < self.min_tokens or self.stalled():
            return None
        keys = self.page_keys(extra_key, key[:end], None)[start // self.page_size :]
        prefetch = Prefetch(self, key[:end].copy(), extra_key, start, keys)
        self.stats.prefetches += 1
        self._read(("lookup", prefetch))
        return prefetch

    def stalled(self) -> bool:
        """The reader has not answered for longer than the timeout (a store that hangs): new
        requests do not wait for it, so a hung store costs its timeout once, not per request."""
        return self._reads_out > 0 and time.monotonic() - self._last_read > self.timeout

    def _read(self, job: tuple) -> None:
        if self._reads_out == 0:
            self._last_read = time.monotonic()
        self._reads_out += 1
        self._reads.put(job)

    def poll(self, timeout: float = 0.0) -> None:
        try:
            result = (
                self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            if result[0] in ("found", "fetched"):
                self._reads_out -= 1
                self._last_read = time.monotonic()
            getattr(self, f"_on_{result[0]}")(*result[1:])
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return

    def _on_found(self, p: Prefetch, num_pages: int) -> None:
        n = num_pages * self.page_size
        slots = None
        if n >= self.min_tokens:
            slots = self.host.alloc(n)
            if slots is None:
                self.cache.evict_host(n - self.host.allocator.free_size())
                slots = self.host.alloc(n)
        if slots is None:
            p.done = True
            return
        pages = self.host.pages_of(slots).tolist()
        p.host_slots = slots
        self._held[id(p)] = slots
        self.host.io_begin(pages)
        self._read(("fetch", p, pages))

    def _on_fetched(self, p: Prefetch, pages: list[int], num_read: int) -> None:
        self.host.io_end(pages)
        slots, p.host_slots = p.host_slots, None
        del self._held[id(p)]
        got = num_read * self.page_size
        if got:
            added = self.cache.attach_host(
                p.token_ids[: p.start + got], p.extra_key, p.start, slots[:got], p.keys[:num_read]
            )
            p.fetched = (p.start + got - added, p.start + got)
            self.stats.pages_from_storage += num_read
            self.stats.bytes_from_storage += num_read * self.host.page_nbytes
        self.host.free(slots[got:])
        p.done = True

    def _on_written(self, pages: list[int], present: int, sent: int, on_done) -> None:
        self.host.io_end(pages)
        self._pending_pages -= len(pages)
        self.stats.pages_to_storage += sent
        self.stats.bytes_to_storage += sent * self.host.page_nbytes
        if on_done is not None and present + sent:
            on_done(present + sent)

    def _on_cleared(self, done: threading.Event, result: ClearResult) -> None:
        self._cleared = result
        done.set()

    def held_host_slots(self) -> torch.Tensor:
        return torch.cat(list(self._held.values())) if self._held else EMPTY_INDICES

    def fill_stats(self, stats: TierStats) -> None:
        stats.storage = self.backend.stats()

    def clear(self, timeout: float = 60.0) -> ClearResult:
        """Delete every page of this model and layout from the store (waits for the writer);
        the result says whether none is left."""
        done = threading.Event()
        self._writes.put(("clear", done))
        deadline = time.monotonic() + timeout
        while not done.is_set() and time.monotonic() < deadline:
            self.poll(timeout=0.05)
        if not done.is_set():
            return ClearResult(False, f"the KV store did not finish clearing in {timeout:g} s")
        return self._cleared

    def close(self) -> None:
        """Finish the write-outs already queued (warm restarts need them), stop the threads."""
        for q in (self._reads, self._writes):
            q.put(None)
        deadline = time.monotonic() + CLOSE_DRAIN_SECONDS
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.poll()
        self.backend.close()

    # ------------------------------------------------------------------ worker threads
    def _work(self, jobs: queue.Queue) -> None:
        while (job := jobs.get()) is not None:
            try:
                self._results.put(self._run(job))
            except Exception:  # a backend bug: count it as a miss, keep the engine going
                log.exception("storage tier: %s failed", job[0])
                self._results.put(self._failed(job))

    def _run(self, job: tuple) -> tuple:
        kind = job[0]
        if kind == "lookup":
            return ("found", job[1], self.backend.exists(job[1].keys))
        if kind == "fetch":
            p, pages = job[1], job[2]
            return (
                "fetched",
                p,
                pages,
                self.backend.get(p.keys[: len(pages)], self.host.pages(pages)),
            )
        if kind == "write":  # pages stored already (another instance's) are not sent again
            _, keys, pages, on_done = job
            present = self.backend.exists(keys, writing=True)
            sent = self.backend.set(keys[present:], self.host.pages(pages[present:]))
            return ("written", pages, present, sent, on_done)
        return ("cleared", job[1], self.backend.clear())

    @staticmethod
    def _failed(job: tuple) -> tuple:
        kind = job[0]
        if kind == "lookup":
            return ("found", job[1], 0)
        if kind == "fetch":
            return ("fetched", job[1], job[2], 0)
        if kind == "write":
            return ("written", job[2], 0, 0, job[3])
        return ("cleared", job[1], ClearResult(False, "the KV store failed; see the log"))


def attach_storage(cache: Any, url: str, model_id: str, capacity_bytes: int | None,
                   min_tokens: int, timeout: float) -> StorageTier:  # fmt: skip
    """Open the backend for ``url`` and put it below ``cache`` (a TieredRadixCache).
    At most a quarter of the host pool waits for write-outs at any time."""
    scope = StorageScope(
        model_id, PageLayout.from_shape(cache.host.device_pool.shape, cache.page_size)
    )
    backend = open_backend(url, scope, capacity_bytes)
    max_pending = max(1, cache.host.allocator.num_pages // 4)
    cache.storage = StorageTier(cache, backend, scope, url, min_tokens, timeout, max_pending)
    return cache.storage
