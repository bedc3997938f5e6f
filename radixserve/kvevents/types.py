"""KV event values, as the cache emits them and as subscribers decode them.

``medium`` says which tier holds the blocks: ``device`` (the engine's KV pool, vLLM's
"GPU"), ``host`` (host memory, "CPU") or ``storage`` ("STORAGE"). ``namespace`` is the
namespace the hashes were salted with; it stays inside the engine (vLLM's wire format has no
field for it: the hash already depends on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MEDIUM_DEVICE = "device"
MEDIUM_HOST = "host"
MEDIUM_STORAGE = "storage"
MEDIUMS = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    namespace: Any = None
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    namespace: Any = None
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    """Events published together (one engine step), stamped with wall time."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
