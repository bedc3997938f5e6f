"""KV cache events for a cache-aware router: which pages a cache stored and removed.

Each cached page is named by a chained hash: ``hash(parent page hash, page tokens, extra_key)``,
so equal hashes mean equal whole prefixes. The radix tree computes hashes and emits events
only when it was given a ``KVEventQueue``; without one, it does no hashing at all.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

# Which tier a page is stored on or removed from (vLLM's events call this the medium).
MEDIUM_DEVICE = "device"
MEDIUM_HOST = "host"
MEDIUM_STORAGE = "storage"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    extra_key: Any = None
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    extra_key: Any = None
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def chain_page_hashes(
    parent_hash: int | None, tokens: np.ndarray, page_size: int, extra_key: Any = None
) -> list[int]:
    """Hashes of the whole pages of ``tokens``, each chained to the one before it."""
    salt = repr(extra_key).encode() if extra_key is not None else b""
    hashes = []
    prev = parent_hash
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(digest_size=8)
        h.update(b"" if prev is None else prev.to_bytes(8, "little"))
        h.update(salt)
        h.update(tokens[start : start + page_size].tobytes())
        prev = int.from_bytes(h.digest(), "little")
        hashes.append(prev)
    return hashes


class KVEventQueue:
    """A bounded buffer of events; the oldest are dropped if nobody drains it."""

    def __init__(self, maxlen: int = 100_000):
        self._events: deque[KVEvent] = deque(maxlen=maxlen)

    def append(self, event: KVEvent) -> None:
        self._events.append(event)

    def drain(self) -> list[KVEvent]:
        out = list(self._events)
        self._events.clear()
        return out
