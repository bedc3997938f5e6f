"""The wire format of the ZeroMQ KV transfer, and the pool reads and writes it carries.

Decode instances connect a DEALER socket to a prefill instance's ROUTER (one connection per
pair). Every message is a ZeroMQ multipart message whose first frame names its kind; ids are
16 raw bytes, small bodies are JSON, KV is raw bytes (never pickled)::

    decode -> prefill                          prefill -> decode
    HELLO  {version, layout}                   WELCOME {layout}   |   REJECT reason
    REQ    tid {num_tokens, meta} blob         DATA   header K V
    CANCEL tid reason                          ABORT  tid reason
    DONE   tid    |   FAIL tid reason          PONG
    PING

A DATA message carries tokens ``[token_start, token_start + num_tokens)`` of one transfer for
layers ``[layer_start, layer_end)``: frame K is the K of those layers, laid out
``[layers, kv_heads, tokens, head_dim]`` in the pool's dtype, frame V the same for V. The
sender gathers it from its pool's slots in one copy and ZeroMQ sends that buffer without
another; the receiver reads the frame in place and scatters it into its own slots.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.disagg.transfer import KVLayout, TransferError

PROTOCOL_VERSION = 1

HELLO, WELCOME, REJECT = b"HELLO", b"WELCOME", b"REJECT"
REQ, DATA, CANCEL, ABORT, DONE, FAIL = b"REQ", b"DATA", b"CANCEL", b"ABORT", b"DONE", b"FAIL"
PING, PONG = b"PING", b"PONG"

_HEADER = struct.Struct("!16sIIHH")


def pack_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(data: bytes) -> Any:
    try:
        return json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError) as e:
        raise TransferError(f"malformed message body: {e}") from e


def text(data: Any) -> str:
    return bytes(data).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class DataHeader:
    tid: bytes
    token_start: int
    num_tokens: int
    layer_start: int
    layer_end: int

    def pack(self) -> bytes:
        return _HEADER.pack(
            self.tid, self.token_start, self.num_tokens, self.layer_start, self.layer_end
        )

    @classmethod
    def unpack(cls, data: bytes) -> DataHeader:
        if len(data) != _HEADER.size:
            raise TransferError(f"a DATA header of {len(data)} bytes, expected {_HEADER.size}")
        return cls(*_HEADER.unpack(data))


def layer_groups(layout: KVLayout, num_tokens: int, target_bytes: int) -> list[tuple[int, int]]:
    """Split the layers into runs whose K frame stays near ``target_bytes`` (at least one
    layer a message), so a long piece goes out as several messages."""
    per_layer = max(1, num_tokens * layout.bytes_per_token_layer())
    step = max(1, min(layout.num_layers, target_bytes // per_layer))
    return [(lo, min(lo + step, layout.num_layers)) for lo in range(0, layout.num_layers, step)]


def gather(pool: KVPool, slots: torch.Tensor, lo: int, hi: int) -> tuple[Any, Any]:
    """K and V rows of ``slots`` for layers ``[lo, hi)`` as two host buffers of bytes ZeroMQ can
    send without copying (each a fresh copy, so the slots may be reused once this returns)."""
    slots = slots.to(pool.device)
    out = []
    for kv in (0, 1):  # an int8 pool's float layers go as int8 rows too (KVPool.layer_rows)
        chunk = pool.layer_rows(kv, lo, hi, slots).cpu().contiguous()  # [layers, heads, n, row]
        out.append(pool.format.as_rows(chunk).numpy())
    return out[0], out[1]


def scatter(
    pool: KVPool, slots: torch.Tensor, lo: int, hi: int, k_buf: Any, v_buf: Any, layout: KVLayout
) -> None:
    """Write one DATA message's K and V frames (rows of bytes) into ``slots`` of layers
    ``[lo, hi)``."""
    row = layout.format.row_bytes(layout.head_dim)
    shape = (hi - lo, layout.num_kv_heads, len(slots), row)
    expected = (hi - lo) * len(slots) * layout.bytes_per_token_layer()
    slots = slots.to(pool.device)
    for kv, buf in ((0, k_buf), (1, v_buf)):
        if len(buf) != expected:
            raise TransferError(f"a KV frame of {len(buf)} bytes, expected {expected}")
        src = torch.frombuffer(buf, dtype=torch.uint8).view(shape).to(pool.device)
        if pool.has_float_layers:
            pool.put_layer_rows(kv, lo, hi, slots, src)
        else:
            pool.format.as_rows((pool.k, pool.v)[kv][lo:hi]).index_copy_(2, slots, src)
