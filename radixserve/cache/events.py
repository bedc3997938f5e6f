"""KV cache events for a cache-aware router: which blocks a cache stored and removed.

The event values and the chained block hash live in ``radixserve.kvevents`` (pure modules a
router imports without the tree); this module re-exports them for the cache and adds the
bounded queue the tree appends to. The radix tree computes hashes and emits events only while
it has a queue (``RadixCache.enable_events``); without one it does no hashing at all.
"""

from __future__ import annotations

from collections import deque

from radixserve.kvevents.hashing import chain_block_hashes, default_block_size
from radixserve.kvevents.types import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

# The older name: a page-aligned block is a page when the block size equals the page size.
chain_page_hashes = chain_block_hashes

__all__ = [
    "MEDIUM_DEVICE",
    "MEDIUM_HOST",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventQueue",
    "chain_block_hashes",
    "chain_page_hashes",
    "default_block_size",
]


class KVEventQueue:
    """A bounded buffer of events; the oldest are dropped if nobody drains it."""

    def __init__(self, maxlen: int = 100_000):
        self._events: deque[KVEvent] = deque(maxlen=maxlen)

    def append(self, event: KVEvent) -> None:
        self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def drain(self) -> list[KVEvent]:
        out = list(self._events)
        self._events.clear()
        return out
