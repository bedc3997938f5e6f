"""What the engine tells the outside world, as typed values (the engine's boundary).

``EngineInfo`` is fixed once the model is loaded; ``EngineStats`` is a snapshot taken after a
step or on request. Both are plain dataclasses of numbers and strings, so they cross a process
boundary by pickling and nobody on the other side reaches into the scheduler, the allocator or
the cache. Token counts are in KV slots (one slot holds one token's K and V in every layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.cache.base import CacheStats
from radixserve.engine.segments import SegmentStats


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
    segments: SegmentStats = field(default_factory=SegmentStats)  # RAG segment reuse counters

    @classmethod
    def idle(cls, kv_capacity_tokens: int) -> EngineStats:
        """A fresh engine's stats: nothing running, nothing cached, every slot free."""
        return cls(0, 0, kv_capacity_tokens, 0, kv_capacity_tokens, 0, 0, 0, 0, CacheStats())

    @property
    def kv_usage(self) -> float:
        """Share of the pool not obtainable now (held by requests or locked in the tree)."""
        return 1.0 - self.kv_available_tokens / self.kv_capacity_tokens
