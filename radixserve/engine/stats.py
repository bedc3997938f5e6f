"""What the engine tells the outside world, as typed values (the engine's boundary).

``EngineInfo`` is fixed once the model is loaded; ``EngineStats`` is a snapshot taken after a
step or on request. Both are plain dataclasses of numbers and strings, so they cross a process
boundary by pickling and nobody on the other side reaches into the scheduler, the allocator or
the cache. Token counts are in KV slots (one slot holds one token's K and V in every layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.base import CacheStats
from radixserve.cache.eviction_base import EvictionStats
from radixserve.cache.pins import PinStats
from radixserve.cache.tier_stats import TierStats
from radixserve.engine.drafts import DraftStats
from radixserve.engine.segments import SegmentStats
from radixserve.structured import GrammarStats


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    page_size: int
    kv_capacity_tokens: int
    kv_bytes: int  # the device pool's size
    kv_bytes_per_token: int
    dtype: str
    prefix_caching: bool
    kv_format: str = ""  # how the device pool stores KV (cache/kv_format.py: float32, int8g16)
    kv_events_block_size: int = 0  # 0: no KV events (no prefix cache)
    kv_events_endpoint: str | None = None  # bound by the engine process's publisher
    kv_events_replay_endpoint: str | None = None
    kv_events_public_key: bytes | None = None  # the publisher's CurveZMQ key; None: plain
    disaggregation: Any = None  # disagg.engine_side.DisaggInfo: mode, KV layout, endpoint
    pin_budget_tokens: int = 0  # 0: nothing is pinned (cache/pins.py)


@dataclass(frozen=True)
class WindowStats:
    """The sliding-window layers' own pool (a model whose window layers keep KV apart)."""

    capacity_tokens: int = 0  # window slots
    used_tokens: int = 0  # held by requests or behind cached tokens
    cached_tokens: int = 0  # cached tokens that still have window KV
    tombstoned_tokens: int = 0  # monotonic: cached tokens whose window KV was dropped


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_capacity_tokens: int
    kv_used_tokens: int  # not free: held by requests or cached in the tree
    kv_available_tokens: int  # obtainable now: free plus evictable
    cached_tokens: int  # held by the tree
    evictable_tokens: int
    num_retractions: int  # monotonic
    step_evicted_tokens: int  # evicted while scheduling the last step
    cache: CacheStats  # monotonic counters of the prefix cache
    tiers: TierStats | None = None  # the host and storage tiers; None without them
    num_loading: int = 0  # admitted, waiting for their KV (from a prefill instance)
    kv_transfer: Any = None  # disagg.transfer.TransferStats in a disaggregation mode
    segments: SegmentStats = field(default_factory=SegmentStats)  # RAG segment reuse counters
    grammar: GrammarStats = field(default_factory=GrammarStats)  # constrained decoding
    window: WindowStats | None = None  # None: no window pool
    # connections the KV-event sockets turned away, by reason (links/guard.py); the engine
    # process fills it in (its publisher is not the engine's)
    kv_events_refused: dict[str, int] = field(default_factory=dict)
    pins: PinStats | None = None  # None: pins are off
    eviction: EvictionStats | None = None  # None: the eviction policy predicts nothing
    drafts: DraftStats = field(default_factory=DraftStats)  # drafts verified, per source

    @classmethod
    def idle(cls, kv_capacity_tokens: int) -> EngineStats:
        """A fresh engine's stats: nothing running, nothing cached, every slot free."""
        return cls(0, 0, kv_capacity_tokens, 0, kv_capacity_tokens, 0, 0, 0, 0, CacheStats())

    @property
    def kv_usage(self) -> float:
        """Share of the pool not obtainable now (held by requests or locked in the tree)."""
        return 1.0 - self.kv_available_tokens / self.kv_capacity_tokens
