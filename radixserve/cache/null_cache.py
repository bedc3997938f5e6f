"""NullCache: the prefix-cache interface with caching switched off (the A/B baseline).

Nothing ever matches; ``insert`` takes ownership of the slots as the contract says and frees
them at once, so a request's slots go back to the allocator when it finishes.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.cache.allocator import PagedAllocator
from radixserve.cache.base import EMPTY_INDICES, CacheStats, MatchResult, PrefixCache, TokenIds


class NullCache(PrefixCache):
    def __init__(self, allocator: PagedAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.stats = CacheStats()

    def match_prefix(
        self, token_ids: TokenIds, extra_key: Any = None, record_stats: bool = True
    ) -> MatchResult:
        if record_stats:
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(token_ids)
        return MatchResult(indices=EMPTY_INDICES, last_node=None, length=0)

    def insert(self, token_ids: TokenIds, indices: torch.Tensor, extra_key: Any = None) -> int:
        if len(indices) != len(token_ids):
            raise ValueError(f"insert: {len(token_ids)} tokens but {len(indices)} slot indices")
        end = len(indices) - len(indices) % self.page_size
        self.allocator.free(indices[:end])
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
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
