"""NullCache: the prefix-cache interface with caching switched off (the A/B baseline).

Nothing ever matches; ``insert`` takes ownership of the slots as the contract says and frees
them at once, so a request's slots go back to the allocator when it finishes. It answers every
call of the interface, so callers never ask which cache they hold.
"""

from __future__ import annotations

import torch

from radixserve.cache.allocator import PagedAllocator
from radixserve.cache.base import (
    EMPTY_INDICES,
    CacheHandle,
    CacheStats,
    MatchResult,
    Namespace,
    PrefixCache,
    PrefixPeek,
    TokenIds,
)


class NullCache(PrefixCache):
    reuses_prefixes = False

    def __init__(self, allocator: PagedAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.stats = CacheStats()

    def match_prefix(
        self, token_ids: TokenIds, namespace: Namespace = None, record_stats: bool = True
    ) -> MatchResult:
        if record_stats:
            self.record_hit(None, len(token_ids), 0)
        return MatchResult(device_indices=EMPTY_INDICES, handle=None, device_len=0)

    def peek_prefix(self, token_ids: TokenIds, namespace: Namespace = None) -> PrefixPeek:
        return PrefixPeek(0)

    def insert(
        self, token_ids: TokenIds, indices: torch.Tensor, namespace: Namespace = None
    ) -> int:
        if len(indices) != len(token_ids):
            raise ValueError(f"insert: {len(token_ids)} tokens but {len(indices)} slot indices")
        end = len(indices) - len(indices) % self.page_size
        self.allocator.free(indices[:end])
        return 0

    def inc_lock_ref(self, handle: CacheHandle) -> None:
        pass

    def dec_lock_ref(self, handle: CacheHandle) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> int:
        return 0

    def check_integrity(self, held_indices: torch.Tensor | None = None) -> None:
        self.allocator.check(EMPTY_INDICES, held_indices)
