"""vLLM's KV-event wire format (as of vLLM v0.11.2), so routers that read vLLM's events
(Dynamo, llm-d, Ray Serve's KV-aware router) read ours.

A published message is three ZeroMQ frames ``[topic, seq, payload]``: ``seq`` an 8-byte
big-endian sequence number (0, 1, 2, ... per publisher), ``payload`` the msgpack encoding of
an ``EventBatch`` the way msgspec encodes vLLM's ``array_like`` structs, tagged events being
arrays whose first element is the class name::

    EventBatch       = [ts: float64, events: [event, ...]] (+ [data_parallel_rank] if set)
    BlockStored      = ["BlockStored", block_hashes: [u64], parent_block_hash: u64 | nil,
                        token_ids: [int], block_size: int, lora_id: nil, medium: str]
    BlockRemoved     = ["BlockRemoved", block_hashes: [u64], medium: str]
    AllBlocksCleared = ["AllBlocksCleared"]

``medium`` uses vLLM's names: "GPU" for our device pool (the tier attention reads), "CPU" for
host memory, "STORAGE" for the storage tier, and "GPU_WINDOWLESS:W" for device blocks whose
sliding-window layers' KV was dropped (``types.py``). A medium the decoder does not know is
kept as sent (a reader skips it, never takes it for the device); a missing one is "GPU". The
decoder also accepts what newer vLLM
releases send (trailing fields such as ``lora_name``, ``extra_keys``, ``group_idx``; events
as maps keyed by field name with a ``type`` tag; hashes as bytes) and ignores what it does
not use.

Replay (vLLM's protocol, on a ROUTER socket): a request ``[b"", start_seq]`` (8 bytes) is
answered with ``[b"", seq, payload]`` for every buffered batch from ``start_seq`` on, then the
end marker ``[b"", -1 (8 bytes, signed), b""]``. Our extension: a request ``[b"", b"DUMP"]``
is answered with ``[b"", S, payload]`` messages holding every block the tree caches now
(``BlockStored`` events, parents first), where ``S`` is the sequence number of the last batch
published before the dump (-1 if none: apply live batches after ``S``), then the end marker,
which is the only message with an empty payload.
"""

from __future__ import annotations

from typing import Any

import msgpack

from radixserve.kvevents.types import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    MEDIUM_STORAGE,
    WINDOWLESS_PREFIX,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

VLLM_VERSION = "0.11.2"
TO_VLLM_MEDIUM = {MEDIUM_DEVICE: "GPU", MEDIUM_HOST: "CPU", MEDIUM_STORAGE: "STORAGE"}
FROM_VLLM_MEDIUM = {v: k for k, v in TO_VLLM_MEDIUM.items()}
VLLM_WINDOWLESS = "GPU_WINDOWLESS:"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DUMP_REQUEST = b"DUMP"


class WireError(ValueError):
    """A message that is not a KV event batch."""


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(data: bytes) -> int:
    if len(data) != 8:
        raise WireError(f"a sequence number has 8 bytes, got {len(data)}")
    return int.from_bytes(data, "big", signed=True)


def to_vllm_medium(medium: str) -> str:
    if medium.startswith(WINDOWLESS_PREFIX):
        return VLLM_WINDOWLESS + medium[len(WINDOWLESS_PREFIX) :]
    return TO_VLLM_MEDIUM.get(medium, medium)


def from_vllm_medium(value: Any) -> str:
    if not isinstance(value, str):
        return MEDIUM_DEVICE
    if value.startswith(VLLM_WINDOWLESS):
        return WINDOWLESS_PREFIX + value[len(VLLM_WINDOWLESS) :]
    return FROM_VLLM_MEDIUM.get(value, value)


def _event_array(e: KVEvent) -> list[Any]:
    if isinstance(e, BlockStored):
        return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids),
                e.block_size, None, to_vllm_medium(e.medium)]  # fmt: skip
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", list(e.block_hashes), to_vllm_medium(e.medium)]
    if isinstance(e, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {e!r}")


def encode_batch(batch: EventBatch) -> bytes:
    body: list[Any] = [float(batch.ts), [_event_array(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def _hash(value: Any) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise WireError(f"a block hash must be an int or bytes, got {type(value).__name__}")


STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium")  # fmt: skip
REMOVED_FIELDS = ("block_hashes", "medium")


def _fields(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):  # newer vLLM: a map with a "type" tag
        return str(raw.get("type")), raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(raw[0], ())
        return raw[0], dict(zip(names, raw[1:], strict=False))
    raise WireError(f"not a tagged KV event: {raw!r}"[:200])


def decode_event(raw: Any) -> KVEvent | None:
    """One event; None for an event type this format does not know (skipped, not fatal)."""
    tag, f = _fields(raw)
    try:
        if tag == "BlockStored":
            parent = f.get("parent_block_hash")
            return BlockStored(
                [_hash(h) for h in f["block_hashes"]],
                None if parent is None else _hash(parent),
                list(f["token_ids"]),
                int(f["block_size"]),
                medium=from_vllm_medium(f.get("medium")),
            )
        if tag == "BlockRemoved":
            return BlockRemoved(
                [_hash(h) for h in f["block_hashes"]], medium=from_vllm_medium(f.get("medium"))
            )
    except (KeyError, TypeError) as e:
        raise WireError(f"malformed {tag} event: {e}") from e
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise WireError(f"not msgpack: {e}") from e
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], (raw[2] if len(raw) > 2 else None)
    else:
        raise WireError("an event batch is [ts, events, ...]")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError("an event batch is [ts: float, events: list, ...]")
    decoded = [e for e in (decode_event(r) for r in events) if e is not None]
    return EventBatch(float(ts), decoded, rank if isinstance(rank, int) else None)
