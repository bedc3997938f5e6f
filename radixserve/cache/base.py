"""The prefix-cache interface shared by ``RadixCache`` and ``NullCache``.

Ownership of KV slots (every slot of the pool is in exactly one place)::

    capacity = free (allocator) + cached (tree) + held (running requests)

    request life:   match_prefix ──> inc_lock_ref(last_node)      prefix slots: tree-owned, locked
                    allocator.alloc ──> new slots                 held by the request
                    insert(tokens, slots) ──> returns k           tree takes slots[k:aligned]
                    caller frees slots[prefix_len:k] (duplicates) and slots[aligned:] (tail)
                    dec_lock_ref(old last_node)

``insert`` takes ownership of ``indices[k:]`` where ``k`` is its return value (the count of
leading tokens already cached). Only page-aligned runs are cached: the caller passes
``len // page_size * page_size`` tokens and keeps the unaligned tail.

Token ids are converted once to an ``int32`` numpy array (``as_token_array``); callers that
already hold one (the engine does) pay nothing for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
EMPTY_INDICES = torch.empty(0, dtype=torch.int64)


def as_token_array(token_ids: TokenIds) -> np.ndarray:
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.int32:
        return token_ids.reshape(-1)
    if isinstance(token_ids, torch.Tensor):
        return token_ids.detach().cpu().numpy().astype(np.int32, copy=False).reshape(-1)
    return np.asarray(token_ids, dtype=np.int32).reshape(-1)


@dataclass
class MatchResult:
    indices: torch.Tensor  # 1-D int64 slot indices of the matched prefix
    last_node: Any  # lock this node to protect the prefix; None for NullCache
    length: int


@dataclass
class CacheStats:
    """Monotonic counters, read by the metrics layer."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    evicted_tokens: int = 0
    evictions: int = 0  # evicted nodes
    evict_calls: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class TreeSummary:
    num_nodes: int
    cached_tokens: int
    top_prefixes: list[dict[str, Any]] = field(default_factory=list)


class PrefixCache(ABC):
    page_size: int
    stats: CacheStats

    @abstractmethod
    def match_prefix(
        self, token_ids: TokenIds, extra_key: Any = None, record_stats: bool = True
    ) -> MatchResult:
        """Longest cached prefix (page-aligned). May split an edge; never changes what is
        cached. ``record_stats=False`` for look-ahead matches (scheduling) that admit nothing."""

    def record_hit(self, node: Any, lookup_tokens: int, hit_tokens: int) -> None:
        """Count one lookup (``match_prefix`` with ``record_stats`` does this itself): the
        counters, and for trees the hit counts of the matched path (which LFU evicts by)."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += lookup_tokens
        self.stats.hit_tokens += hit_tokens

    @abstractmethod
    def insert(self, token_ids: TokenIds, indices: torch.Tensor, extra_key: Any = None) -> int:
        """Cache ``token_ids -> indices``; return how many leading tokens were cached already."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` if that many are evictable; return tokens freed."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> int:
        """Drop everything unlocked; return tokens freed."""

    @abstractmethod
    def check_integrity(self, held_indices: torch.Tensor | None = None) -> None:
        """Raise ``AssertionError`` if an invariant is broken. With ``held_indices`` (every slot
        held by running requests), also check free + cached + held == capacity exactly."""

    def summary(self, top: int = 10) -> TreeSummary:
        return TreeSummary(num_nodes=0, cached_tokens=self.total_size())
