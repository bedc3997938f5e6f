"""Per-worker load as the router sees it, and the least-loaded worker in O(log N).

Load is counted in prompt-token equivalents: the uncached prompt tokens of requests routed to
a worker that have not produced their first token yet (their prefill is still ahead), plus
``decode_weight`` per request in flight (each slows every step while it decodes). Only the
router's own tickets change it, so it is exact for one router and needs no polling.

Ties go to the worker whose load changed least recently (``least_loaded`` and
``tie_key``): among idle workers, the one idle longest, so equal workers take turns.

``least_loaded`` uses a lazy min-heap: every change pushes a fresh entry and older entries of
that worker go stale; stale entries are skipped when popped and the heap is rebuilt when it
grows past a few entries per worker. So a change and a query cost O(log N), never O(N).

``work`` (what the fair-share gate compares, ``PolicyConfig.share_ratio``) is the work routed
to each worker, decayed exponentially in time with ``work_half_life`` seconds (None: never
decays), so a burst an hour ago stops counting against a worker while the last minutes'
share still does. Decaying every worker at every request would cost O(N); instead values are
stored scaled by ``2 ** ((now - origin) / half_life)`` (a new amount is multiplied by the
current scale, old ones keep theirs), so comparisons between workers and with the mean need
no update, and the gate's absolute slack is scaled instead. The origin moves (O(N), once per
~40 half-lives) before the scale can overflow.

``occupied`` (the fair-share gate's other measure, ``share_measure="occupancy"``) is the time
each worker had at least one of the router's requests in flight, decayed the same way: what
a worker actually spent on its requests (long answers included), observed by the router
with no model of their cost. Intervals are closed when the worker's last request finishes
(``change`` with ``now``); an open interval counts up to ``now``, and the fleet's total of
open intervals is kept as a count and a sum of start times, so the mean is O(1) too.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Collection

_REBASE_HALF_LIVES = 40.0  # rescale stored work before 2 ** this grows past float precision


class LoadBoard:
    def __init__(
        self,
        decode_weight: float,
        work_half_life: float | None = None,
        occupancy_ties: bool = False,
    ):
        if work_half_life is not None and not work_half_life > 0:
            raise ValueError(f"work_half_life must be > 0 seconds (or None), got {work_half_life}")
        self.decode_weight = decode_weight
        # ties between equal loads go to the least occupied worker (else the longest unchanged)
        self.occupancy_ties = occupancy_ties
        self.work_half_life = work_half_life
        self.running: dict[str, int] = {}
        self.pending: dict[str, float] = {}
        self.epoch: dict[str, int] = {}  # a worker that leaves and comes back starts afresh
        self._version: dict[str, int] = {}
        self._heap: list[tuple[float, float, int, str]] = []  # load, tie, version, worker
        # work routed to each worker (uncached prompt tokens + decode_weight per request),
        # decayed and stored scaled (module docstring): read it with ``work_of``
        self._work: dict[str, float] = {}
        self._total_work = 0.0
        self._origin: float | None = None  # the time at which the scale is 1
        # occupancy: closed intervals (stored scaled, like work) and the open ones' starts
        self._occupied: dict[str, float] = {}
        self._total_occupied = 0.0
        self._busy_since: dict[str, float] = {}
        self._routes = 0.0  # requests routed, decayed and stored scaled like work
        self._since_sum = 0.0
        self._clock: float | None = None  # the latest time a caller gave
        self._counter = itertools.count()

    def __contains__(self, worker: str) -> bool:
        return worker in self.running

    def __len__(self) -> int:
        return len(self.running)

    def add_worker(self, worker: str) -> None:
        if worker not in self.running:
            self.running[worker], self.pending[worker] = 0, 0.0
            self.epoch[worker] = next(self._counter)
            # a newcomer starts level with the mean, not starved of work (stored units)
            self._work[worker] = self._total_work / len(self._work) if self._work else 0.0
            self._total_work += self._work[worker]
            n = len(self._occupied)
            self._occupied[worker] = self._total_occupied / n if n else 0.0
            self._total_occupied += self._occupied[worker]
            self._push(worker)

    def remove_worker(self, worker: str) -> None:
        self.running.pop(worker, None)
        self.pending.pop(worker, None)
        self.epoch.pop(worker, None)
        self._total_work -= self._work.pop(worker, 0.0)
        self._total_occupied -= self._occupied.pop(worker, 0.0)
        if worker in self._busy_since:
            self._since_sum -= self._busy_since.pop(worker)
        self._version.pop(worker, None)  # its heap entries are all stale now

    def load(self, worker: str) -> float:
        return self.pending[worker] + self.decode_weight * self.running[worker]

    def add_work(self, worker: str, amount: float, now: float) -> None:
        self._clock = now
        if worker in self._work:
            self._routes += self._scale(now)
            amount *= self._scale(now)
            self._work[worker] += amount
            self._total_work += amount

    def work_of(self, worker: str, now: float) -> float:
        """The worker's decayed work at ``now``."""
        return self._work[worker] / self._scale(now)

    def mean_work(self, now: float) -> float:
        if not self._work:
            return 0.0
        return self._total_work / len(self._work) / self._scale(now)

    def over_share(self, worker: str, ratio: float, slack: float, now: float) -> bool:
        """Whether the worker's work exceeds ``ratio`` x the mean + ``slack`` (at ``now``): one
        comparison in stored units, O(1)."""
        mean = self._total_work / len(self._work)
        return self._work[worker] > ratio * mean + slack * self._scale(now)

    def occupied_of(self, worker: str, now: float) -> float:
        """Seconds the worker had a request in flight (decayed; an open interval up to now)."""
        scale = self._scale(now)
        since = self._busy_since.get(worker)
        return self._occupied[worker] / scale + (now - since if since is not None else 0.0)

    def over_occupied_share(self, worker: str, ratio: float, noise: float, now: float) -> bool:
        """Whether the worker's occupancy exceeds ``ratio`` x the fleet's mean by more than
        ``noise`` standard deviations of count noise (at ``now``). A worker dealt a Poisson
        number of requests, each occupying it ``s`` seconds, ``mean / s`` of them on average,
        deviates from the mean by ``sqrt(mean x s)`` seconds without any imbalance in the
        routing: that much is not held against it. O(1); open intervals count up to now."""
        scale = self._scale(now)
        since = self._busy_since.get(worker)
        own = self._occupied[worker] + (scale * (now - since) if since is not None else 0.0)
        total = self._total_occupied + scale * (len(self._busy_since) * now - self._since_sum)
        mean = total / len(self._occupied)  # stored units: seconds x scale
        per_request = total / self._routes if self._routes else 0.0  # seconds
        return own > ratio * mean + noise * math.sqrt(max(mean, 0.0) * per_request * scale)

    def _occupy(self, worker: str, busy_before: bool, now: float) -> None:
        """Open or close the worker's occupied interval as its first request starts or its
        last one ends."""
        busy = self.running[worker] > 0
        if busy and not busy_before:
            self._busy_since[worker] = now
            self._since_sum += now
        elif busy_before and not busy and worker in self._busy_since:
            since = self._busy_since.pop(worker)
            self._since_sum -= since
            amount = (now - since) * self._scale(now)
            self._occupied[worker] += amount
            self._total_occupied += amount

    def _scale(self, now: float) -> float:
        half_life = self.work_half_life
        if half_life is None:
            return 1.0
        if self._origin is None:
            self._origin = now
        exponent = (now - self._origin) / half_life
        if exponent > _REBASE_HALF_LIVES:  # move the origin to now: every value / 2**exponent
            factor = 2.0**-exponent
            self._work = {w: v * factor for w, v in self._work.items()}
            self._total_work = math.fsum(self._work.values())
            self._occupied = {w: v * factor for w, v in self._occupied.items()}
            self._total_occupied = math.fsum(self._occupied.values())
            self._routes *= factor
            if self.occupancy_ties:  # the heap's tie keys were in the old units
                self._rebuild_heap()
            self._origin, exponent = now, 0.0
        return 2.0**exponent

    def tie_key(self, worker: str) -> tuple[float, int]:
        """What orders workers of equal load or cost, smallest first: with
        ``occupancy_ties`` its closed occupancy (stored units: comparable between workers at
        any time), then an increasing stamp of its last change (the smallest has been idle,
        or unchanged, longest)."""
        occupied = self._occupied[worker] if self.occupancy_ties else 0.0
        return occupied, self._version[worker]

    def change(
        self,
        worker: str,
        running: int = 0,
        pending: float = 0.0,
        epoch: int | None = None,
        now: float | None = None,
    ) -> None:
        """Add to a worker's counters. A change for a worker removed meanwhile, or for an
        earlier membership of it (``epoch``), is ignored: its counters started afresh.
        ``now`` times occupancy (None: the latest time a caller gave)."""
        if worker not in self.running or (epoch is not None and epoch != self.epoch[worker]):
            return
        if now is None:
            now = self._clock
        else:
            self._clock = now
        busy_before = self.running[worker] > 0
        self.running[worker] += running
        if running and now is not None:
            self._occupy(worker, busy_before, now)
        self.pending[worker] = max(0.0, self.pending[worker] + pending)
        self._push(worker)

    def _push(self, worker: str) -> None:
        version = next(self._counter)
        self._version[worker] = version
        heapq.heappush(self._heap, (self.load(worker), *self.tie_key(worker), worker))
        if len(self._heap) > 4 * len(self.running) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(self.load(w), *self.tie_key(w), w) for w in self._version]
        heapq.heapify(self._heap)

    def least_loaded(self, exclude: Collection[str] = ()) -> str | None:
        heap, skipped, found = self._heap, [], None
        while heap:
            _, _, version, worker = heap[0]
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
