"""What the lower cache tiers report: sizes, pages moved per direction, load latency.

``TierStats`` is a plain dataclass snapshot (it crosses the engine's process boundary inside
``EngineStats``); counters are monotonic, sizes are gauges. ``LatencyHistogram`` keeps fixed
buckets so the metrics layer exports it as a Prometheus histogram without seeing samples.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field
from typing import Any

LOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                2.5, 5.0)  # fmt: skip


@dataclass
class LatencyHistogram:
    buckets: tuple[float, ...] = LOAD_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or below it), ending with ``+Inf``."""
        out, running = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class TierStats:
    write_policy: str = ""
    host_capacity_tokens: int = 0
    host_cached_tokens: int = 0  # tokens whose KV has a host copy (some also on the device)
    host_bytes_per_token: int = 0
    # pages and bytes moved, per direction (monotonic)
    pages_to_host: int = 0
    bytes_to_host: int = 0
    pages_to_device: int = 0
    bytes_to_device: int = 0
    pages_to_storage: int = 0
    bytes_to_storage: int = 0
    pages_from_storage: int = 0
    bytes_from_storage: int = 0
    # events (monotonic)
    host_evicted_tokens: int = 0
    loads: int = 0  # load-backs done (host -> device)
    partial_loads: int = 0  # ... of which only a leading part fitted on the device
    load_failures: int = 0  # load-backs skipped: no device room even after eviction
    backup_failures: int = 0  # copies to the host skipped: no host room
    prefetches: int = 0  # storage lookups started for waiting requests
    prefetch_timeouts: int = 0  # requests admitted before their prefetch finished
    storage_write_skipped_pages: int = 0  # not written: too many writes pending
    backup_seconds: float = 0.0  # time spent copying device -> host (inside steps)
    lookup_wait_seconds: float = 0.0  # steps' starts waiting for storage lookups (``poll``)
    prefetches_in_flight: int = 0  # storage reads not answered yet (gauge)
    load_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    storage_url: str | None = None  # None: no storage tier
    storage: Any = None  # the backend's own StorageStats snapshot

    def snapshot(self) -> TierStats:
        return copy.deepcopy(self)
