"""The prefix-cache interface shared by ``RadixCache`` and ``NullCache``.

Ownership of KV slots (every slot of the pool is in exactly one place)::

    capacity = free (allocator) + cached (tree) + held (running requests)

    request life:   match_prefix ──> inc_lock_ref(handle)          prefix slots: tree-owned, locked
                    allocator.alloc ──> new slots                  held by the request
                    insert(tokens, slots) ──> returns k            tree takes slots[k:aligned]
                    caller frees slots[prefix_len:k] (duplicates) and slots[aligned:] (tail)
                    dec_lock_ref(old handle)

``insert`` takes ownership of ``indices[k:]`` where ``k`` is its return value (the count of
leading tokens already cached). Only page-aligned runs are cached: the caller passes
``len // page_size * page_size`` tokens and keeps the unaligned tail.

A match describes one contiguous cached prefix, tier by tier: ``device_len`` tokens whose KV
is in the device pool now (``device_indices``), then ``host_len`` tokens held in host memory,
then ``storage_len`` tokens a storage backend holds. Only the device part can be read by
attention; the lower tiers must be loaded first, by the tier controller the engine holds
beside the cache (``lower_tiers.py``). The ``handle`` is opaque: callers pass it back to lock,
unlock and credit the prefix, and never look inside. ``peek_prefix`` answers "how long is the
cached prefix?" without touching anything (no split, no recency update).

Token ids are converted once to an ``int32`` numpy array (``as_token_array``); callers that
already hold one (the engine does) pay nothing for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from radixserve.cache.allocator import PagedAllocator

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
# A cache namespace: None (shared), a tenant's, or one derived from a tenant's (a RAG segment
# store: ``("rag-segment", tenant)``). Namespaces never share nodes; hashes salt with its repr.
Namespace = str | tuple[str, str | None] | None
EMPTY_INDICES = torch.empty(0, dtype=torch.int64)
CacheHandle = Any  # opaque to callers: whatever the cache needs to find the matched prefix


def as_token_array(token_ids: TokenIds) -> np.ndarray:
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.int32:
        return token_ids.reshape(-1)
    if isinstance(token_ids, torch.Tensor):
        return token_ids.detach().cpu().numpy().astype(np.int32, copy=False).reshape(-1)
    return np.asarray(token_ids, dtype=np.int32).reshape(-1)


@dataclass
class MatchResult:
    """The longest cached prefix: device part first, then the parts on lower tiers."""

    device_indices: torch.Tensor  # 1-D int64 slots of the device part
    handle: CacheHandle  # lock it to protect the prefix; None when nothing matched
    device_len: int
    host_len: int = 0
    storage_len: int = 0
    lower_handle: CacheHandle = None  # opaque: the end of the host part, for load_back

    @property
    def total_len(self) -> int:
        return self.device_len + self.host_len + self.storage_len


@dataclass(frozen=True)
class PrefixPeek:
    """What ``peek_prefix`` sees: the cached length over all tiers and the path of nodes it
    runs through (opaque, hashable ids from the root down; schedulers group requests by it)."""

    length: int
    path: tuple[Hashable, ...] = ()


@dataclass
class CacheStats:
    """Monotonic counters, read by the metrics layer."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0  # every tier; of which:
    host_hit_tokens: int = 0  # loaded back from the host tier
    storage_hit_tokens: int = 0  # fetched from the storage tier
    evicted_tokens: int = 0
    evictions: int = 0  # evicted nodes
    evict_calls: int = 0

    def copy(self) -> CacheStats:
        return CacheStats(**self.__dict__)


@dataclass
class TreeSummary:
    num_nodes: int
    cached_tokens: int
    top_prefixes: list[dict[str, Any]] = field(default_factory=list)


class PrefixCache(ABC):
    allocator: PagedAllocator  # the device pool's (``WindowedAllocator``: window layers apart)
    page_size: int
    stats: CacheStats
    # False for a cache that keeps nothing (NullCache): publishing a running request's prefix
    # or waiting for another request's prefix to land would gain nothing.
    reuses_prefixes: bool = True

    @abstractmethod
    def match_prefix(
        self, token_ids: TokenIds, namespace: Namespace = None, record_stats: bool = True
    ) -> MatchResult:
        """Longest cached prefix (page-aligned). May split an edge; never changes what is
        cached. ``record_stats=False`` for matches that admit nothing."""

    @abstractmethod
    def peek_prefix(self, token_ids: TokenIds, namespace: Namespace = None) -> PrefixPeek:
        """The length ``match_prefix`` would return over all tiers, without any side effect:
        no split, no recency or hit update, no statistics."""

    def record_hit(
        self,
        handle: CacheHandle,
        lookup_tokens: int,
        hit_tokens: int,
        host_tokens: int = 0,
        storage_tokens: int = 0,
    ) -> None:
        """Count one lookup (``match_prefix`` with ``record_stats`` does this itself): the
        counters, and for trees the hit counts of the matched path (which LFU evicts by).
        ``hit_tokens`` counts every tier; ``host_tokens`` and ``storage_tokens`` are its parts
        that came from those tiers."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += lookup_tokens
        self.stats.hit_tokens += hit_tokens
        self.stats.host_hit_tokens += host_tokens
        self.stats.storage_hit_tokens += storage_tokens

    @abstractmethod
    def insert(
        self, token_ids: TokenIds, indices: torch.Tensor, namespace: Namespace = None
    ) -> int:
        """Cache ``token_ids -> indices``; return how many leading tokens were cached already."""

    @abstractmethod
    def inc_lock_ref(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` if that many are evictable; return tokens freed."""

    def evict_windows(self, num_tokens: int) -> int:
        """Drop the window layers' KV of at least ``num_tokens`` cached tokens where no
        request needs it (models with window layers kept apart; ``window_tree.py``)."""
        return 0

    def window_evictable_size(self) -> int:
        return 0

    def set_turn_end_ids(self, token_ids: Iterable[int]) -> None:
        """Token ids that end a chat turn (a model's end-of-turn and end-of-text tokens): a
        conversation, or another one sharing its first messages, may resume right after one.
        A model with window layers kept apart keeps the window KV before such points longer
        than elsewhere on a path (``window_tree.py``); other caches have no use for them."""
        return None

    def obtainable(self) -> tuple[int, int | None]:
        """Slots obtainable now in the device pool and in its window pool (None: no window
        pool): free ones plus what the tree could evict, or drop the window KV of."""
        main = self.allocator.free_size() + self.evictable_size()
        if not self.allocator.windowed:
            return main, None
        return main, self.allocator.window_free_size() + self.window_evictable_size()

    def room(self) -> int:
        """Slots obtainable now in both pools at once (``obtainable``)."""
        main, window = self.obtainable()
        return main if window is None else min(main, window)

    def make_room(self, num_slots: int, window_slots: int | None = None) -> None:
        """Evict, and drop window KV no request reads, until ``num_slots`` slots can be
        allocated in the device pool, ``window_slots`` of them (default: all) with window
        pages (as far as the tree allows)."""
        self.evict(num_slots - self.allocator.free_size())
        if self.allocator.windowed:
            window = num_slots if window_slots is None else window_slots
            self.evict_windows(window - self.allocator.window_free_size())

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

    # KV events (``events.py``): a cache that keeps nothing has nothing to announce.
    event_block_size: int = 0
    events: Any = None  # the queue events go to while they are on; None while off

    def enable_events(self, queue: Any) -> None:
        """Emit what is cached now, then every change, to ``queue`` (a ``KVEventQueue``)."""
        return None

    def disable_events(self) -> None:
        """Stop emitting (and hashing)."""
        return None

    def snapshot_events(self) -> list[Any]:
        """Every cached block as ``BlockStored`` events, parents first."""
        return []
