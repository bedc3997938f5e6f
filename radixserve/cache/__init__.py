"""KV storage and the prefix cache: pool, slot allocator, radix tree, null cache, events."""

from radixserve.cache.allocator import OutOfSlotsError, PagedAllocator
from radixserve.cache.base import (
    CacheHandle,
    CacheStats,
    MatchResult,
    PrefixCache,
    PrefixPeek,
    as_token_array,
)
from radixserve.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventQueue
from radixserve.cache.eviction import EVICTION_POLICIES
from radixserve.cache.kv_pool import KVPool, KVShape
from radixserve.cache.null_cache import NullCache
from radixserve.cache.radix_cache import RadixCache, TreeNode

__all__ = [
    "EVICTION_POLICIES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheHandle",
    "CacheStats",
    "KVEventQueue",
    "KVPool",
    "KVShape",
    "MatchResult",
    "NullCache",
    "OutOfSlotsError",
    "PagedAllocator",
    "PrefixCache",
    "PrefixPeek",
    "RadixCache",
    "TreeNode",
    "as_token_array",
]
