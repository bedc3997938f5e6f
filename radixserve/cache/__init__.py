"""KV storage and the prefix cache: pool, slot allocator, radix tree and its listeners, null
cache, events, the lower tiers as the engine holds them."""

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
from radixserve.cache.lower_tiers import NO_TIERS, LowerTiers
from radixserve.cache.null_cache import NullCache
from radixserve.cache.radix_cache import RadixCache, TreeNode
from radixserve.cache.tree_listener import TreeListener

__all__ = [
    "EVICTION_POLICIES",
    "NO_TIERS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheHandle",
    "CacheStats",
    "KVEventQueue",
    "KVPool",
    "KVShape",
    "LowerTiers",
    "MatchResult",
    "NullCache",
    "OutOfSlotsError",
    "PagedAllocator",
    "PrefixCache",
    "PrefixPeek",
    "RadixCache",
    "TreeListener",
    "TreeNode",
    "as_token_array",
]
