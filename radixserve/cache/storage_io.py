"""StorageIO: the storage tier's (L3) worker threads, queues and acknowledgements.

The tier controller (``tier_controller.py``) owns one and is its only user; this module knows
the host pool and a storage backend, never the tree. Threads: the tree and both pools belong
to the main (step) thread. Worker threads make every backend call: ``READERS`` readers
(``exists`` lookups and ``get`` fetches, for prefetches; several, so that one request's slow
read does not make the next requests wait for theirs) sharing one queue, and a writer
(``set`` write-outs and ``clear``) with its own; all post results to one queue that the main
thread applies in ``poll``. Host pages a worker reads or writes are busy in the host pool
meanwhile (freeing one defers until ``io_end``), and the pages allocated for a fetch are held
by its ``Prefetch`` until ``poll`` hands them back to the controller.

- Blocks: the store keeps KV in blocks of ``block_tokens`` (whole host pages, any number),
  one key each, so a small page size does not mean one file or key per page. For a model
  with sliding-window layers a block carries one flag: whether it holds their KV (the
  writer says which; a fetch reports what was stored, ``Fetched.windows``).
- Write-out: with more than ``max_pending_pages`` waiting, a write-out is skipped and
  counted: a step never waits for storage.
- Prefetch: ``lookup`` asks the reader how many of a prefetch's pages storage holds; ``poll``
  allocates host pages for them (``alloc_host``, the controller's: it may evict host leaves)
  and asks the reader to fetch them, then returns the finished fetches for the controller to
  hang below the cached prefix. The scheduler admits the request once its ``Prefetch`` is
  done, or after ``timeout`` seconds (then it computes those pages; a fetch that lands
  later still fills the tree).
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

import numpy as np
import torch

from radixserve.cache.base import EMPTY_INDICES, Namespace
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.storage import ClearResult, StorageBackend
from radixserve.cache.tier_stats import TierStats

log = logging.getLogger("radixserve")
CLOSE_DRAIN_SECONDS = 60.0  # at shutdown, how long pending write-outs may take to finish
READERS = 4  # reader threads: a slow lookup or fetch does not hold up the next request's


@dataclass
class Prefetch:
    """One waiting request's fetch from storage; the scheduler polls ``done``."""

    stats: TierStats
    timeout: float
    token_ids: np.ndarray
    namespace: Namespace
    start: int  # tokens cached (device or host) when it began: the fetch starts there
    keys: list[bytes]  # keys of the pages from ``start`` on
    started: float = field(default_factory=time.monotonic)
    host_slots: torch.Tensor | None = None  # held while the fetch runs
    fetched: tuple[int, int] = (0, 0)  # token range this fetch added to the tree
    done: bool = False
    timed_out: bool = False

    def expired(self, now: float) -> bool:
        return not self.done and now - self.started > self.timeout

    def give_up(self) -> None:
        """The request stops waiting (it computes instead); the fetch may still land."""
        if not self.timed_out:
            self.timed_out = True
            self.stats.prefetch_timeouts += 1

    def tokens_from_storage(self, lo: int, hi: int) -> int:
        """How many of the tokens ``[lo, hi)`` this fetch brought."""
        return max(0, min(hi, self.fetched[1]) - max(lo, self.fetched[0]))


@dataclass
class Fetched:
    """A finished fetch: the blocks read into the first slots of ``host_slots``, one flag each
    in ``windows`` (whether it holds the window layers' KV); the controller owns all of
    ``host_slots`` now."""

    prefetch: Prefetch
    host_slots: torch.Tensor
    windows: list[bool]


class StorageIO:
    def __init__(self, host: HostKVPool, backend: StorageBackend, stats: TierStats,
                 alloc_host: Callable[[int], torch.Tensor | None], block_tokens: int,
                 min_tokens: int, timeout: float, max_pending_pages: int):  # fmt: skip
        if block_tokens % host.page_size:
            raise ValueError(f"a storage block ({block_tokens} tokens) is not whole pages")
        self.host, self.backend, self.stats = host, backend, stats
        self.alloc_host = alloc_host
        self.block_tokens = block_tokens
        self.per_block = block_tokens // host.page_size  # host pages per stored block
        self.min_tokens, self.timeout = max(min_tokens, block_tokens), timeout
        self.max_pending_pages = max_pending_pages
        self._pending_pages = 0
        self._reads_out = 0  # reader jobs not answered yet
        self._lookups_out = 0  # ... of which lookups
        self._last_read = time.monotonic()  # when the reader last answered (or went idle)
        self._held: dict[int, torch.Tensor] = {}  # id(prefetch) -> host slots being fetched
        self._cleared = ClearResult(False)  # what the last clear did
        self._results: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        queues = [(self._reads, f"reader{i}") for i in range(READERS)]
        self._threads = [
            threading.Thread(
                target=self._work, args=(q,), name=f"radixserve-storage-{name}", daemon=True
            )  # fmt: skip
            for q, name in [*queues, (self._writes, "writer")]
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ main thread
    def write(self, keys: list[bytes], host_slots: torch.Tensor, windows: list[bool],
              on_done: Callable[[int], None] | None = None) -> None:  # fmt: skip
        """Write these host slots out as blocks under ``keys`` (one per block; ``windows``:
        whether each holds the window layers' KV), asynchronously; ``on_done(leading blocks
        now in the store)`` in poll."""
        pages = self.host.pages_of(host_slots).tolist()
        if self._pending_pages + len(pages) > self.max_pending_pages:
            self.stats.storage_write_skipped_pages += len(pages)
            return
        self._pending_pages += len(pages)
        self.host.io_begin(pages)
        self._writes.put(("write", keys, pages, windows, on_done))

    def lookup(self, token_ids: np.ndarray, namespace: Namespace, start: int,
               keys: list[bytes]) -> Prefetch:  # fmt: skip
        """Ask the store how many of ``keys`` (the blocks from token ``start`` on) it holds,
        then fetch them: the returned ``Prefetch`` is done once ``poll`` handed them over."""
        prefetch = Prefetch(self.stats, self.timeout, token_ids, namespace, start, keys)
        self.stats.prefetches += 1
        self._lookups_out += 1
        self._read(("lookup", prefetch))
        return prefetch

    def stalled(self) -> bool:
        """The reader has not answered for longer than the timeout (a store that hangs): new
        requests do not wait for it, so a hung store costs its timeout once, not per request."""
        return self._reads_out > 0 and time.monotonic() - self._last_read > self.timeout

    def reads_in_flight(self) -> int:
        """Lookups and fetches asked of the reader and not answered yet."""
        return self._reads_out

    def lookups_in_flight(self) -> int:
        """Lookups (``exists`` questions) asked of the readers and not answered yet."""
        return self._lookups_out

    def _read(self, job: tuple) -> None:
        if self._reads_out == 0:
            self._last_read = time.monotonic()
        self._reads_out += 1
        self._reads.put(job)

    def poll(self, timeout: float = 0.0) -> list[Fetched]:
        """Apply the workers' answers (waiting up to ``timeout`` s for the first); return the
        fetches that finished, for the controller to hang in the tree."""
        fetched: list[Fetched] = []
        try:
            result = (
                self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait()
            )
        except queue.Empty:
            return fetched
        while True:
            if result[0] in ("found", "fetched"):
                self._reads_out -= 1
                self._last_read = time.monotonic()
            if result[0] == "fetched":
                fetched.append(self._on_fetched(*result[1:]))
            else:
                getattr(self, f"_on_{result[0]}")(*result[1:])
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return fetched

    def _on_found(self, p: Prefetch, num_blocks: int) -> None:
        self._lookups_out -= 1
        n = num_blocks * self.block_tokens
        slots = self.alloc_host(n) if n >= self.min_tokens else None
        if slots is None:
            p.done = True
            return
        pages = self.host.pages_of(slots).tolist()
        p.host_slots = slots
        self._held[id(p)] = slots
        self.host.io_begin(pages)
        self._read(("fetch", p, pages))

    def _on_fetched(self, p: Prefetch, pages: list[int], windows: list[bool]) -> Fetched:
        self.host.io_end(pages)
        slots, p.host_slots = p.host_slots, None
        del self._held[id(p)]
        self.stats.pages_from_storage += len(windows) * self.per_block
        self.stats.bytes_from_storage += self._payload_bytes(windows)
        p.done = True
        return Fetched(p, slots, windows)

    def _on_written(self, pages: list[int], present: int, sent: list[bool], on_done) -> None:
        self.host.io_end(pages)
        self._pending_pages -= len(pages)
        self.stats.pages_to_storage += len(sent) * self.per_block
        self.stats.bytes_to_storage += self._payload_bytes(sent)
        sent = len(sent)
        if on_done is not None and present + sent:
            on_done(present + sent)

    def _on_cleared(self, done: threading.Event, result: ClearResult) -> None:
        self._cleared = result
        done.set()

    def _payload_bytes(self, windows: list[bool]) -> int:
        layout = self.backend.layout
        return sum(layout.payload_nbytes(w) for w in windows)

    def held_host_slots(self) -> torch.Tensor:
        return torch.cat(list(self._held.values())) if self._held else EMPTY_INDICES

    def clear(self, timeout: float = 60.0) -> tuple[list[Fetched], ClearResult]:
        """Delete every page of this model and layout from the store (waits for the writer);
        returns the fetches that finished meanwhile, and whether none of the pages is left."""
        done = threading.Event()
        self._writes.put(("clear", done))
        deadline = time.monotonic() + timeout
        fetched: list[Fetched] = []
        while not done.is_set() and time.monotonic() < deadline:
            fetched += self.poll(timeout=0.05)
        if not done.is_set():
            return fetched, ClearResult(False, f"the KV store did not clear in {timeout:g} s")
        return fetched, self._cleared

    def close(self) -> list[Fetched]:
        """Finish the write-outs already queued (warm restarts need them), stop the threads;
        returns the fetches that finished meanwhile."""
        for _ in range(READERS):
            self._reads.put(None)
        self._writes.put(None)
        deadline = time.monotonic() + CLOSE_DRAIN_SECONDS
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        fetched = self.poll()
        self.backend.close()
        return fetched

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
            blocks = self.host.pages(pages, self.per_block)
            got = self.backend.get(p.keys[: len(blocks)], blocks)
            return ("fetched", p, pages, blocks.windows[:got])
        if kind == "write":  # blocks stored already (another instance's) are not sent again
            _, keys, pages, windows, on_done = job
            present = self.backend.exists(keys, writing=True)
            rest = self.host.pages(pages[present * self.per_block :], self.per_block,
                                   windows[present:])  # fmt: skip
            sent = self.backend.set(keys[present:], rest)
            return ("written", pages, present, windows[present : present + sent], on_done)
        return ("cleared", job[1], self.backend.clear())

    @staticmethod
    def _failed(job: tuple) -> tuple:
        kind = job[0]
        if kind == "lookup":
            return ("found", job[1], 0)
        if kind == "fetch":
            return ("fetched", job[1], job[2], [])
        if kind == "write":
            return ("written", job[2], 0, [], job[4])
        return ("cleared", job[1], ClearResult(False, "the KV store failed; see the log"))
