"""Routing policies: which worker serves a request. Pure code shared by ``radixserve router``,
the Ray Serve request router and the simulator.

No HTTP, no asyncio, no clock: callers pass ``now`` (seconds, any origin) and feed KV events
in, so simulated workers and simulated time drive the same code. Every policy keeps the load
counters through tickets: ``route`` returns a ``Route`` whose ``ticket`` the caller ends with
``finish`` exactly once, on every path (success, client abort, worker error, retry), and a
second ``finish`` of a ticket is a no-op, so no path can leave a counter up. ``first_token``
marks the end of a request's prefill (its uncached tokens stop counting as pending work).

Policies (``POLICIES``): ``cache-aware`` (default), ``round-robin``, ``least-load``,
``power-of-two``, ``consistent-hash``. ``cache-aware`` scores a few candidates, never the
fleet: the deepest holders of the prompt's prefix (``BlockIndex.candidates``) plus the
least-loaded worker (``LoadBoard``, O(log N)). Its cost for worker ``w`` is::

    uncached prompt tokens on w (+ tier_cost x tokens held only on host/storage) + load(w)

and a holder whose load exceeds ``gate_ratio x least load + gate_tokens`` is not a candidate
for this request (the load gate is per request and per holder, not a fleet-wide switch), so an
overloaded worker loses new work while every other conversation keeps its affinity. With
``share_ratio`` set (the default; None turns it off), a holder whose recent share exceeds
``share_ratio`` x the fleet's mean is not a candidate either: the gate above compares
instantaneous loads, which at low utilization are all near zero, so a popular prefix's
holders would otherwise take its traffic whenever idle (a fair-share gate). The share is
``share_measure``: "occupancy" (the default), the seconds each worker had a request in flight
(``LoadBoard.occupied_of``: what it actually spent, long answers included, which routed
tokens cannot tell in advance), decayed with a ``share_half_life`` in seconds, allowing
``share_noise`` standard deviations of the count noise a fair deal has anyway, ties going to
the least occupied worker; or "work" (``LoadBoard.work_of``: routed uncached tokens +
``decode_weight`` per request, decayed the same way, allowing ``gate_tokens``).
Among equal costs the worker whose load changed least recently wins (idle longest), and
where many workers hold the prefix the candidates are drawn at random among them: both
keep a popular prefix's holders taking turns instead of the same few taking everything.

A request names its prompt by chained block hashes (``kvevents.hashing``) of ``block_size``
tokens; ``prefill`` / ``decode`` sets (disaggregation) are separate policy objects. A worker
whose events name window-less blocks (a model with sliding-window layers) counts as holding
only the part of a prefix it can resume from (``BlockIndex.resumable``).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from radixserve.kvevents.types import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from radixserve.router.index import TIER_BITS, BlockIndex
from radixserve.router.load import LoadBoard

SHARE_MEASURES = ("work", "occupancy")
POLICIES = ("cache-aware", "round-robin", "least-load", "power-of-two", "consistent-hash")


class NoWorkerError(RuntimeError):
    """No worker can take the request (none registered, or all excluded)."""


@dataclass
class PolicyConfig:
    block_size: int = 16  # tokens per hashed block (the workers' KV event block size)
    decode_weight: float = 32.0  # load of one in-flight request, in prompt tokens
    gate_ratio: float = 2.0
    gate_tokens: float = 512.0
    candidates: int = 8  # holders scored per request (deepest first)
    approx_ttl: float = 30.0  # s an approximate entry waits for its confirming event
    approx_ttl_no_events: float = 600.0  # s for workers that publish no events
    host_cost: float = 0.1  # cost of a token held on host, relative to recomputing it
    storage_cost: float = 0.3
    hash_blocks: int = 8  # consistent-hash: the prefix (in blocks) that picks the worker
    virtual_nodes: int = 64  # consistent-hash: ring points per worker
    # cache-aware fair-share gate (None: off): a holder whose recent share exceeds
    # share_ratio x the fleet's mean (+ the allowance below) is not a candidate. Defaults
    # by evidence (docs/simulator.md, "Routing at scale"): >= 96% of the pooled hit rate with
    # busy imbalance <= 1.3 at N = 2 ... 1,000 simulated instances
    share_ratio: float | None = 1.05
    share_half_life: float = 600.0  # s: the gate's memory (what it counts decays by half)
    # what the gate compares: "occupancy" (seconds with a request in flight, as the router
    # saw them) or "work" (routed uncached tokens + decode_weight per request, + gate_tokens)
    share_measure: str = "occupancy"
    share_noise: float = 1.0  # occupancy gate: standard deviations of count noise allowed

    def __post_init__(self) -> None:
        for name in ("block_size", "candidates", "hash_blocks", "virtual_nodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not self.share_half_life > 0:
            raise ValueError(f"share_half_life must be > 0 seconds, got {self.share_half_life}")
        for name in ("decode_weight", "gate_tokens", "host_cost", "storage_cost"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.gate_ratio < 1:
            raise ValueError(f"gate_ratio must be >= 1, got {self.gate_ratio}")
        if self.share_measure not in SHARE_MEASURES:
            raise ValueError(
                f"share_measure must be one of {', '.join(SHARE_MEASURES)}, "
                f"got {self.share_measure!r}"
            )
        if self.share_noise < 0:
            raise ValueError(f"share_noise must be >= 0, got {self.share_noise}")
        if self.share_ratio == math.inf:  # "--share-ratio off"
            self.share_ratio = None
        if self.share_ratio is not None and self.share_ratio < 1:
            raise ValueError(f"share_ratio must be >= 1 (or None), got {self.share_ratio}")
        if self.approx_ttl <= 0 or self.approx_ttl_no_events <= 0:
            raise ValueError("approximate-entry TTLs must be positive")


@dataclass(frozen=True)
class RouteRequest:
    block_hashes: Sequence[int]  # chained hashes of the prompt's whole blocks
    num_tokens: int  # prompt length
    session_key: str | None = None  # consistent-hash: a conversation or user id


@dataclass(frozen=True)
class Route:
    worker: str
    ticket: int
    cached_tokens: int  # predicted: the prefix the worker holds (0 for cache-blind policies)
    source: str  # "exact" (events), "approx" (routing history), "none"
    headers: Mapping[str, str] = field(default_factory=dict)  # for the worker (router/pd.py)


@dataclass
class PolicyStats:
    routes: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    predicted_tokens: int = 0  # sum of predicted cached tokens
    reported_tokens: int = 0  # sum of the cached tokens workers reported
    confirmed_tokens: int = 0  # sum of min(predicted, reported): precision's numerator
    by_source: dict[str, int] = field(default_factory=dict)


@dataclass
class _Ticket:
    worker: str
    epoch: int  # the worker's membership the ticket counts against
    pending: float
    predicted: int
    prompt_tokens: int


class Policy:
    """Workers, load counters and tickets; subclasses implement ``choose``."""

    name = "base"

    def __init__(self, config: PolicyConfig | None = None, seed: int = 0):
        self.config = config or PolicyConfig()
        cfg = self.config
        occupancy = cfg.share_ratio is not None and cfg.share_measure == "occupancy"
        self.board = LoadBoard(cfg.decode_weight, cfg.share_half_life, occupancy_ties=occupancy)
        self.workers: list[str] = []  # in registration order
        self.stats = PolicyStats()
        self._tickets: dict[int, _Ticket] = {}
        self._next_ticket = 0
        self._rng = random.Random(seed)

    # ------------------------------------------------------------------ workers
    def add_worker(self, worker: str, has_events: bool = False) -> None:
        if worker not in self.board:
            self.workers.append(worker)
            self.board.add_worker(worker)

    def remove_worker(self, worker: str) -> None:
        if worker in self.board:
            self.workers.remove(worker)
            self.board.remove_worker(worker)

    def apply_events(self, worker: str, events: Sequence[KVEvent]) -> None:
        """KV events published by ``worker`` (cache-blind policies ignore them)."""

    def worker_lost_events(self, worker: str) -> None:
        """The worker's event stream broke or restarted: forget what it said."""

    # ------------------------------------------------------------------ requests
    def choose(
        self, request: RouteRequest, now: float, exclude: Collection[str]
    ) -> tuple[str, int, str]:
        """(worker, predicted cached tokens, source); a worker not in ``exclude``."""
        raise NotImplementedError

    def route(self, request: RouteRequest, now: float, exclude: Collection[str] = ()) -> Route:
        if not self.workers:
            raise NoWorkerError("no workers are registered")
        worker, cached, source = self.choose(request, now, exclude)
        cached = min(cached, request.num_tokens)
        ticket = self._next_ticket
        self._next_ticket += 1
        pending = float(request.num_tokens - cached)
        epoch = self.board.epoch[worker]
        self._tickets[ticket] = _Ticket(worker, epoch, pending, cached, request.num_tokens)
        self.board.change(worker, running=1, pending=pending, now=now)
        self.board.add_work(worker, pending + self.config.decode_weight, now)
        s = self.stats
        s.routes += 1
        s.prompt_tokens += request.num_tokens
        s.predicted_tokens += cached
        s.by_source[source] = s.by_source.get(source, 0) + 1
        return Route(worker, ticket, cached, source)

    def first_token(self, ticket: int, now: float | None = None) -> None:
        t = self._tickets.get(ticket)
        if t is not None and t.pending:
            self.board.change(t.worker, pending=-t.pending, epoch=t.epoch, now=now)
            t.pending = 0.0

    def finish(
        self, ticket: int, cached_tokens: int | None = None, now: float | None = None
    ) -> None:
        """End a ticket (idempotent); ``cached_tokens`` is what the worker reported, ``now``
        the time (for occupancy; None: the latest time the policy was given)."""
        t = self._tickets.pop(ticket, None)
        if t is None:
            return
        self.board.change(t.worker, running=-1, pending=-t.pending, epoch=t.epoch, now=now)
        self.stats.finished += 1
        if cached_tokens is not None:
            self.stats.reported_tokens += cached_tokens
            self.stats.confirmed_tokens += min(cached_tokens, t.predicted)

    def in_flight(self) -> int:
        return len(self._tickets)

    def _least_loaded(self, exclude: Collection[str]) -> str:
        worker = self.board.least_loaded(exclude)
        if worker is None:
            raise NoWorkerError("no worker can take this request")
        return worker


class RoundRobin(Policy):
    name = "round-robin"
    _next = 0

    def choose(self, request, now, exclude):
        for _ in range(len(self.workers)):
            worker = self.workers[self._next % len(self.workers)]
            self._next += 1
            if worker not in exclude:
                return worker, 0, "none"
        raise NoWorkerError("no worker can take this request")


class LeastLoad(Policy):
    name = "least-load"

    def choose(self, request, now, exclude):
        return self._least_loaded(exclude), 0, "none"


class PowerOfTwo(Policy):
    name = "power-of-two"

    def choose(self, request, now, exclude):
        pool = self.workers
        picks = [w for w in self._rng.sample(pool, min(2, len(pool))) if w not in exclude]
        if not picks:
            return self._least_loaded(exclude), 0, "none"
        return min(picks, key=self.board.load), 0, "none"


class ConsistentHash(Policy):
    """A ring of ``virtual_nodes`` points per worker; the key is the session key, else the
    hash naming the prompt's first ``hash_blocks`` blocks (prompts shorter than one block go
    to the least-loaded worker)."""

    name = "consistent-hash"

    def __init__(self, config: PolicyConfig | None = None, seed: int = 0):
        super().__init__(config, seed)
        self._ring: list[tuple[int, str]] = []

    @staticmethod
    def _point(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")

    def add_worker(self, worker, has_events=False):
        super().add_worker(worker, has_events)
        for i in range(self.config.virtual_nodes):
            bisect.insort(self._ring, (self._point(f"{worker}#{i}"), worker))

    def remove_worker(self, worker):
        super().remove_worker(worker)
        self._ring = [p for p in self._ring if p[1] != worker]

    def choose(self, request, now, exclude):
        if request.session_key is not None:
            key = self._point(request.session_key)
        elif request.block_hashes:
            key = request.block_hashes[min(len(request.block_hashes), self.config.hash_blocks) - 1]
        else:
            return self._least_loaded(exclude), 0, "none"
        i = bisect.bisect_left(self._ring, (key, ""))
        for step in range(len(self._ring)):
            worker = self._ring[(i + step) % len(self._ring)][1]
            if worker not in exclude:
                return worker, 0, "none"
        raise NoWorkerError("no worker can take this request")


class CacheAware(Policy):
    name = "cache-aware"

    def __init__(self, config: PolicyConfig | None = None, seed: int = 0):
        super().__init__(config, seed)
        self.index = BlockIndex()
        self._has_events: dict[str, bool] = {}

    def add_worker(self, worker, has_events=False):
        super().add_worker(worker, has_events)
        self._has_events[worker] = has_events

    def set_has_events(self, worker: str, has_events: bool) -> None:
        if worker in self._has_events:
            self._has_events[worker] = has_events

    def remove_worker(self, worker):
        super().remove_worker(worker)
        self._has_events.pop(worker, None)
        self.index.clear_worker(worker)

    def apply_events(self, worker, events):
        if worker not in self.board:
            return
        index = self.index
        for e in events:
            if isinstance(e, BlockStored):
                index.store(worker, e.block_hashes, e.medium)
            elif isinstance(e, BlockRemoved):
                index.remove(worker, e.block_hashes, e.medium)
            elif isinstance(e, AllBlocksCleared):
                index.clear_worker(worker)

    def worker_lost_events(self, worker):
        self.index.clear_worker(worker)

    def _tier_penalty(self, worker: str, hashes: Sequence[int], blocks: int) -> float:
        """Tokens held by ``worker`` only on host or storage, weighted by their tier cost."""
        index, cost = self.index, 0.0
        for h in hashes[:blocks]:
            mask = index.tier_mask(worker, h)
            if mask and not mask & TIER_BITS[MEDIUM_DEVICE]:
                tier = MEDIUM_HOST if mask & TIER_BITS[MEDIUM_HOST] else MEDIUM_STORAGE
                cost += self.config.host_cost if tier == MEDIUM_HOST else self.config.storage_cost
        return cost * self.config.block_size

    def choose(self, request, now, exclude):
        cfg, index, board = self.config, self.index, self.board
        hashes = request.block_hashes
        index.sweep(now)
        lightest = self._least_loaded(exclude)
        floor = board.load(lightest)
        gate = cfg.gate_ratio * floor + cfg.gate_tokens
        share = cfg.share_ratio
        occupancy = cfg.share_measure == "occupancy"
        depth = index.deepest(hashes, now)
        found = index.candidates(hashes, depth, now, cfg.candidates, self._rng) if depth else {}
        if lightest not in found:
            found[lightest] = index.depth_of(lightest, hashes, depth, now) if depth else 0
        # a worker resumes only where the window before the end has its window layers' KV
        found = {w: index.resumable(w, hashes, b, cfg.block_size) for w, b in found.items()}
        best, best_cost = lightest, None
        for worker, blocks in found.items():
            if worker in exclude or worker not in board:
                continue
            load = board.load(worker)
            if worker != lightest and (load > gate or (share is not None and (
                board.over_occupied_share(worker, share, cfg.share_noise, now) if occupancy
                else board.over_share(worker, share, cfg.gate_tokens, now)
            ))):  # fmt: skip
                continue  # overloaded for this request: its prefix is not worth the wait
            uncached = max(request.num_tokens - blocks * cfg.block_size, 0)
            cost = uncached + load
            if index.lower_tier_entries:
                cost += self._tier_penalty(worker, hashes, blocks)
            cost_key = (cost, board.tie_key(worker))  # ties: least occupied / longest unchanged
            if best_cost is None or cost_key < best_cost:
                best, best_cost = worker, cost_key
        blocks = found.get(best, 0)
        source = "none"
        if blocks:
            exact = index.tier_mask(best, hashes[blocks - 1]) != 0
            source = "exact" if exact else "approx"
        ttl = cfg.approx_ttl if self._has_events.get(best) else cfg.approx_ttl_no_events
        index.insert_approx(best, hashes, now + ttl)
        return best, blocks * cfg.block_size, source


POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (CacheAware, RoundRobin, LeastLoad, PowerOfTwo, ConsistentHash)
}


def make_policy(name: str, config: PolicyConfig | None = None, seed: int = 0) -> Policy:
    if name not in POLICY_CLASSES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICY_CLASSES[name](config, seed)
