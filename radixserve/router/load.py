"""Per-worker load as the router sees it, and the least-loaded worker in O(log N).

Load is counted in prompt-token equivalents: the uncached prompt tokens of requests routed to
a worker that have not produced their first token yet (their prefill is still ahead), plus
``decode_weight`` per request in flight (each slows every step while it decodes). Only the
router's own tickets change it, so it is exact for one router and needs no polling.

Ties go to the worker whose load changed least recently (``least_loaded`` and
``last_change``): among idle workers, the one idle longest, so equal workers take turns.

``least_loaded`` uses a lazy min-heap: every change pushes a fresh entry and older entries of
that worker go stale; stale entries are skipped when popped and the heap is rebuilt when it
grows past a few entries per worker. So a change and a query cost O(log N), never O(N).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection


class LoadBoard:
    def __init__(self, decode_weight: float):
        self.decode_weight = decode_weight
        self.running: dict[str, int] = {}
        self.pending: dict[str, float] = {}
        self.epoch: dict[str, int] = {}  # a worker that leaves and comes back starts afresh
        self._version: dict[str, int] = {}
        self._heap: list[tuple[float, int, str]] = []
        # work routed to each worker so far (uncached prompt tokens + decode_weight per
        # request): the long-run share the fair-share gate compares (``PolicyConfig.share_ratio``)
        self.work: dict[str, float] = {}
        self._total_work = 0.0
        self._counter = itertools.count()

    def __contains__(self, worker: str) -> bool:
        return worker in self.running

    def __len__(self) -> int:
        return len(self.running)

    def add_worker(self, worker: str) -> None:
        if worker not in self.running:
            self.running[worker], self.pending[worker] = 0, 0.0
            self.epoch[worker] = next(self._counter)
            self.work[worker] = self.mean_work()  # a newcomer starts level, not starved of it
            self._total_work += self.work[worker]
            self._push(worker)

    def remove_worker(self, worker: str) -> None:
        self.running.pop(worker, None)
        self.pending.pop(worker, None)
        self.epoch.pop(worker, None)
        self._total_work -= self.work.pop(worker, 0.0)
        self._version.pop(worker, None)  # its heap entries are all stale now

    def load(self, worker: str) -> float:
        return self.pending[worker] + self.decode_weight * self.running[worker]

    def add_work(self, worker: str, amount: float) -> None:
        if worker in self.work:
            self.work[worker] += amount
            self._total_work += amount

    def mean_work(self) -> float:
        return self._total_work / len(self.work) if self.work else 0.0

    def last_change(self, worker: str) -> int:
        """An increasing stamp of the worker's last change: among equal loads, the smallest
        has been idle (or unchanged) longest."""
        return self._version[worker]

    def change(
        self, worker: str, running: int = 0, pending: float = 0.0, epoch: int | None = None
    ) -> None:
        """Add to a worker's counters. A change for a worker removed meanwhile, or for an
        earlier membership of it (``epoch``), is ignored: its counters started afresh."""
        if worker not in self.running or (epoch is not None and epoch != self.epoch[worker]):
            return
        self.running[worker] += running
        self.pending[worker] = max(0.0, self.pending[worker] + pending)
        self._push(worker)

    def _push(self, worker: str) -> None:
        version = next(self._counter)
        self._version[worker] = version
        heapq.heappush(self._heap, (self.load(worker), version, worker))
        if len(self._heap) > 4 * len(self.running) + 64:
            self._heap = [(self.load(w), v, w) for w, v in self._version.items()]
            heapq.heapify(self._heap)

    def least_loaded(self, exclude: Collection[str] = ()) -> str | None:
        heap, skipped, found = self._heap, [], None
        while heap:
            load, version, worker = heap[0]
            if self._version.get(worker) != version:
                heapq.heappop(heap)  # stale
                continue
            if worker in exclude:
                skipped.append(heapq.heappop(heap))
                continue
            found = worker
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def total_running(self) -> int:
        return sum(self.running.values())
