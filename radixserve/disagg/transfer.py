"""KV transfer between a prefill instance and a decode instance: the interface.

Roles. The decode instance owns the destination slots and asks for KV; the prefill instance
computes it and sends it. One transfer moves the K and V of ``num_tokens`` consecutive tokens
of one sequence, every layer, from the prefill pool's slots into the decode pool's slots::

    decode (KVReceiver)                           prefill (KVSender)
    tid = request(peer, dst_slots, meta, blob) ──REQ──>  incoming() -> TransferRequest
                                                         (the engine computes the tokens)
    progress(): data lands in dst_slots   <──DATA──  push(tid, src_slots)  (in token order,
                                                         any number of pieces, layer-chunked)
    progress() -> (tid, DONE)             ──DONE──>  finished() -> (tid, DONE)

- ``meta`` (JSON-able) and ``blob`` (bytes) are the engine's business (token ids, how much the
  decode side already holds); the transport carries them untouched.
- A handshake per prefill/decode pair checks that both pools hold the same thing
  (``KVLayout``: model identity, layers, heads, head size, KV format, page size); a mismatch fails
  every transfer to that peer with an error naming the fields that differ.
- Heartbeats both ways: a peer silent for ``heartbeat_timeout`` seconds is dead and its
  transfers fail on both sides. A transfer also fails at its own deadline (``timeout_s``).
- Only the engine's thread reads or writes the pool: ``push`` copies the slots out before it
  returns (so the prefill side may free them at once), and data lands in the decode pool only
  inside ``progress``. After ``cancel`` (decode) or ``abort`` (prefill) returns, nothing more
  is read or written for that transfer, so its slots can be released. Both calls also tell
  the other side, which stops working on it.
- ``fileno()`` is a descriptor that becomes readable when ``progress``/``incoming``/
  ``finished`` have something new: an engine loop that sleeps waits on it too.

Backends: ``zmq`` (TCP, any machine). A GPU backend (NIXL, Mooncake's transfer engine) would
implement the same two classes, writing straight into device memory.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from radixserve.cache.kv_format import KVFormat
from radixserve.cache.kv_pool import KVPool


class TransferError(RuntimeError):
    """A transfer or a connection to a peer failed; the message says why."""


class LayoutMismatchError(TransferError):
    """The two instances' KV pools do not hold the same thing: no KV can move between them."""


@dataclass(frozen=True)
class KVLayout:
    """What one slot of a KV pool holds; equal on both sides, or no transfer is possible."""

    model_id: str  # model name plus a fingerprint of its architecture and weights
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_format: str  # the pool's KVFormat by name: "float32", "bfloat16", "int8g16", ...
    page_size: int

    @classmethod
    def of_pool(cls, pool: KVPool, model_id: str, page_size: int) -> KVLayout:
        s = pool.shape
        return cls(model_id, s.num_layers, s.num_kv_heads, s.head_dim, pool.format.name, page_size)

    @property
    def format(self) -> KVFormat:
        return KVFormat.parse(self.kv_format)

    def bytes_per_token_layer(self) -> int:
        """Bytes of K (or of V) of one token in one layer: its rows, one per KV head."""
        return self.num_kv_heads * self.format.row_bytes(self.head_dim)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.bytes_per_token_layer()

    def mismatch(self, other: KVLayout) -> list[str]:
        """Human-readable differences, empty when the layouts match."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} here, {getattr(other, f.name)!r} there"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        try:
            return cls(**{f.name: d[f.name] for f in fields(cls)})
        except (KeyError, TypeError) as e:
            raise TransferError(f"malformed KV layout {d!r}") from e


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class TransferStatus:
    state: TransferState
    reason: str | None = None  # why it failed
    tokens: int = 0  # tokens whose KV landed (decode) or was sent (prefill), all layers
    bytes: int = 0
    kind: str = ""  # a failure's kind, as counted in TransferStats.failures


@dataclass(frozen=True)
class TransferRequest:
    """What the prefill side sees of a transfer a decode instance asked for."""

    transfer_id: str
    num_tokens: int
    meta: dict[str, Any]
    blob: bytes
    peer: str  # an opaque name of the decode instance (for logs)


@dataclass
class TransferStats:
    """Monotonic counters of one side."""

    transfers_done: int = 0
    transfers_failed: int = 0
    tokens: int = 0
    bytes: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # by kind: timeout, peer_lost, ...
    # a sender's: connections its socket turned away, by reason (links/guard.py)
    refused: dict[str, int] = field(default_factory=dict)

    def count_failure(self, kind: str) -> None:
        self.transfers_failed += 1
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def copy(self) -> TransferStats:
        return TransferStats(
            self.transfers_done,
            self.transfers_failed,
            self.tokens,
            self.bytes,
            dict(self.failures),
            dict(self.refused),
        )


class KVReceiver(ABC):
    """The decode side: asks a prefill peer for KV and lands it in its own pool's slots."""

    layout: KVLayout
    stats: TransferStats

    @abstractmethod
    def request(
        self,
        peer: str,
        dst_slots: torch.Tensor,
        meta: dict[str, Any],
        blob: bytes = b"",
        timeout_s: float = 60.0,
    ) -> str:
        """Ask ``peer`` (a sender's endpoint) for the KV of ``len(dst_slots)`` tokens; return
        the transfer id. Never blocks: a failure shows up in ``progress``."""

    @abstractmethod
    def progress(self) -> list[tuple[str, TransferStatus]]:
        """Land what arrived in the pool; return the transfers that ended since the last call
        (each exactly once, DONE or FAILED). Ended transfers are forgotten."""

    @abstractmethod
    def status(self, transfer_id: str) -> TransferStatus | None:
        """A pending transfer's progress; None once it ended (or if unknown)."""

    @abstractmethod
    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Stop a transfer: after return nothing lands in its slots; the peer is told."""

    @abstractmethod
    def probe(self, peer: str) -> Future:
        """Handshake with ``peer`` in the background (never blocks): the future's result is
        its layout, or it fails with ``TransferError`` / ``LayoutMismatchError``."""

    def check_peer(self, peer: str, timeout_s: float = 10.0) -> KVLayout:
        """Handshake with ``peer`` now; return its layout or raise ``TransferError`` /
        ``LayoutMismatchError``."""
        try:
            return self.probe(peer).result(timeout_s)
        except FutureTimeout as e:
            raise TransferError(f"no handshake with {peer} within {timeout_s:g} s") from e

    @abstractmethod
    def fileno(self) -> int: ...

    @abstractmethod
    def close(self) -> None: ...


class KVSender(ABC):
    """The prefill side: serves transfer requests from decode instances out of its pool."""

    layout: KVLayout
    stats: TransferStats
    endpoint: str  # what decode instances connect to

    @abstractmethod
    def incoming(self) -> list[TransferRequest]:
        """Transfers asked for since the last call (from peers whose handshake passed)."""

    @abstractmethod
    def push(self, transfer_id: str, src_slots: torch.Tensor) -> None:
        """Send the KV of the transfer's next ``len(src_slots)`` tokens. The slots are read
        before this returns. Raises ``TransferError`` for an unknown or ended transfer or one
        pushed past its length."""

    @abstractmethod
    def abort(self, transfer_id: str, reason: str) -> None:
        """Give up a transfer (the decode side sees it fail with ``reason``)."""

    @abstractmethod
    def finished(self) -> list[tuple[str, TransferStatus]]:
        """Transfers that ended since the last call, each once: DONE when the decode side
        confirmed every token, FAILED when it cancelled one or went silent."""

    @abstractmethod
    def fileno(self) -> int: ...

    @abstractmethod
    def close(self) -> None: ...
