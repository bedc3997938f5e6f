"""KV event values, as the cache emits them and as subscribers decode them.

``medium`` says which tier holds the blocks: ``device`` (the engine's KV pool, vLLM's
"GPU"), ``host`` (host memory, "CPU") or ``storage`` ("STORAGE"). ``namespace`` is the
namespace the hashes were salted with; it stays inside the engine (vLLM's wire format has no
field for it: the hash already depends on it).

**Window-less blocks.** A model with sliding-window layers of window ``W`` may drop the
window layers' KV of device blocks while keeping the global layers' (a *tombstone*,
``cache/window_tree.py``). Such blocks form one more medium, ``windowless_medium(W)``
(``"windowless:W"``; on the wire ``"GPU_WINDOWLESS:W"``): ``BlockStored`` on it says these
device blocks lost their window-layer KV, ``BlockRemoved`` on it that they have it again or
are about to leave the device. A block is window-less when any of its tokens is. The
window-less blocks are always a subset of the device blocks: they are announced after the
device's ``BlockStored`` and withdrawn before its ``BlockRemoved``, so a reader that keeps
one set of blocks per medium and does not know this one holds blocks that are really there
(the global layers' KV), never a block that is gone, and never loses a device block over
it. ``medium_window`` reads ``W`` back, which a router needs to cut a match where the
engine would (the ``W - 1`` tokens before a resume point need their window KV). A model
without window layers sends no such event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MEDIUM_DEVICE = "device"
MEDIUM_HOST = "host"
MEDIUM_STORAGE = "storage"
MEDIUMS = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE)
WINDOWLESS_PREFIX = "windowless:"


def windowless_medium(window: int) -> str:
    """The medium of device blocks without the window layers' KV, for a window of ``window``
    tokens (the keys a window layer reads, its own token included)."""
    return f"{WINDOWLESS_PREFIX}{window}"


def medium_window(medium: str | None) -> int | None:
    """``W`` of a window-less medium; None for any other medium."""
    if not medium or not medium.startswith(WINDOWLESS_PREFIX):
        return None
    digits = medium[len(WINDOWLESS_PREFIX) :]
    return int(digits) if digits.isdigit() and int(digits) > 0 else None


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
