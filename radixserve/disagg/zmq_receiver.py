"""The decode side of the ZeroMQ KV transfer (see ``transfer.py`` for the contract and
``wire.py`` for the messages): what the engine thread does with it.

``ZmqKVReceiver`` keeps the transfers it asked for and lands their KV in the pool inside
``progress``; every socket lives in its I/O thread (``zmq_receiver_io.py``: one connection
per prefill peer, the handshake, heartbeats, the sealed data connection). Per layer, token
ranges must arrive in order and fit the transfer, else it fails and the peer is told to stop
(FAIL); a transfer past its deadline, or cancelled here, tells the peer CANCEL; DONE once
every layer holds every token. A peer the I/O thread dropped fails all its transfers with the
reason it gave (the next request to it connects afresh).

Each socket takes the process's ``security``: with CurveZMQ it expects the server key the peer
endpoint carries (``tcp://HOST:PORT?curve=KEY``), or its own public key (a fleet key pair), so
a process that cannot prove it holds that key never completes the handshake and sends
nothing that could land in the pool. With keys, the KV itself arrives over a second, plain
connection to the port the peer's WELCOME names, sealed with AES-256-GCM under keys agreed
in the handshake (``zmq_sealed.py``); a message there that fails its seal drops the peer.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.disagg import wire
from radixserve.disagg.transfer import (
    KVLayout,
    KVReceiver,
    TransferError,
    TransferState,
    TransferStats,
    TransferStatus,
)
from radixserve.disagg.zmq_io import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT
from radixserve.disagg.zmq_receiver_io import ReceiverIO
from radixserve.disagg.zmq_sealed import SEALED
from radixserve.links.keys import ZmqSecurity


@dataclass
class _Inbound:
    peer: str
    dst: torch.Tensor
    deadline: float
    timeout_s: float
    next_token: list[int]  # per layer: tokens landed so far
    bytes: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.dst)

    @property
    def landed(self) -> int:
        return min(self.next_token)


class ZmqKVReceiver(KVReceiver):
    def __init__(
        self,
        pool: KVPool,
        layout: KVLayout,
        *,
        security: ZmqSecurity,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        sealed_data: bool = True,
    ):
        """``sealed_data=False``: with keys, ask for the KV over CurveZMQ itself (its cipher
        is several times slower; for comparison)."""
        self.pool, self.layout = pool, layout
        self.stats = TransferStats()
        beat = (heartbeat_interval, heartbeat_timeout)
        self._io = ReceiverIO(layout, security, sealed_data, *beat)
        self._io.start()
        self._inbound: dict[str, _Inbound] = {}
        self._ended: list[tuple[str, TransferStatus]] = []

    def request(self, peer, dst_slots, meta, blob=b"", timeout_s=60.0) -> str:
        if len(dst_slots) < 1:
            raise ValueError("a transfer needs at least one token")
        tid = uuid.uuid4()
        dst = dst_slots.to(torch.int64, copy=True).cpu()
        deadline = time.monotonic() + timeout_s
        layers = [0] * self.layout.num_layers
        self._inbound[tid.hex] = _Inbound(peer, dst, deadline, timeout_s, layers)
        head = wire.pack_json({"num_tokens": len(dst), "meta": meta})
        self._io.command("request", peer, [wire.REQ, tid.bytes, head, blob])
        return tid.hex

    def _end(self, key: str, state: TransferState, reason: str | None = None, kind: str = ""):
        inb = self._inbound.pop(key)
        if state is TransferState.DONE:
            self.stats.transfers_done += 1
        else:
            self.stats.count_failure(kind)
        status = TransferStatus(state, reason, inb.landed, inb.bytes, kind)
        self._ended.append((key, status))

    def _tell(self, peer: str, kind: bytes, key: str, reason: str = "") -> None:
        frames = [kind, uuid.UUID(key).bytes] + ([reason.encode()] if kind != wire.DONE else [])
        self._io.command("notify", peer, frames)

    def progress(self) -> list[tuple[str, TransferStatus]]:
        for event in self._io.drain():
            kind = event[0]
            if kind == "data":
                self._land(*event[1:])
            elif kind == "abort":
                key = uuid.UUID(bytes=event[1]).hex
                if key in self._inbound:
                    self._end(key, TransferState.FAILED, f"prefill side: {event[2]}", "aborted")
            elif kind == "peer_failed":
                _, peer, reason, failure = event
                for key in [k for k, inb in self._inbound.items() if inb.peer == peer]:
                    self._end(key, TransferState.FAILED, reason, failure)
        now = time.monotonic()
        for key, inb in list(self._inbound.items()):
            if now > inb.deadline:
                reason = (
                    f"timed out after {inb.timeout_s:g} s with {inb.landed} of "
                    f"{inb.num_tokens} tokens landed"
                )
                self._tell(inb.peer, wire.CANCEL, key, reason)
                self._end(key, TransferState.FAILED, reason, "timeout")
        ended, self._ended = self._ended, []
        return ended

    def _land(self, peer: str, header: bytes, k_buf: Any, v_buf: Any) -> None:
        try:
            h = wire.DataHeader.unpack(header)
        except TransferError:
            return  # no transfer to blame; the deadline ends whatever waits
        key = uuid.UUID(bytes=h.tid).hex
        inb = self._inbound.get(key)
        if inb is None:  # cancelled or timed out here: make the sender stop
            self._tell(peer, wire.CANCEL, key, "the transfer ended on the decode side")
            return
        end = h.token_start + h.num_tokens
        try:
            if not 0 <= h.layer_start < h.layer_end <= self.layout.num_layers:
                raise TransferError(f"layers {h.layer_start}..{h.layer_end} out of range")
            if h.num_tokens < 1 or end > inb.num_tokens:
                raise TransferError(f"tokens {h.token_start}..{end} outside 0..{inb.num_tokens}")
            if any(inb.next_token[i] != h.token_start for i in range(h.layer_start, h.layer_end)):
                raise TransferError(f"tokens {h.token_start}..{end} arrived out of order")
            wire.scatter(
                self.pool, inb.dst[h.token_start : end], h.layer_start, h.layer_end,
                k_buf, v_buf, self.layout,
            )  # fmt: skip
        except TransferError as e:
            reason = f"bad KV data from the prefill side: {e}"
            self._tell(peer, wire.FAIL, key, reason)
            self._end(key, TransferState.FAILED, reason, "bad_data")
            return
        for i in range(h.layer_start, h.layer_end):
            inb.next_token[i] = end
        layers = h.layer_end - h.layer_start
        nbytes = 2 * layers * h.num_tokens * self.layout.bytes_per_token_layer()
        inb.bytes += nbytes
        self.stats.bytes += nbytes
        if inb.landed == inb.num_tokens:
            self.stats.tokens += inb.num_tokens
            self._tell(peer, wire.DONE, key)
            self._end(key, TransferState.DONE)

    def status(self, transfer_id: str) -> TransferStatus | None:
        inb = self._inbound.get(transfer_id)
        if inb is None:
            return None
        return TransferStatus(TransferState.PENDING, None, inb.landed, inb.bytes)

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        inb = self._inbound.pop(transfer_id, None)
        if inb is not None:
            self._tell(inb.peer, wire.CANCEL, transfer_id, reason)

    def probe(self, peer: str) -> Future:
        fut: Future = Future()
        self._io.command("check", peer, fut)
        return fut

    def refused(self) -> dict[str, int]:
        """Messages on sealed data connections that failed their seal (``sealed``)."""
        return {SEALED: self._io.refused} if self._io.refused else {}

    def fileno(self) -> int:
        return self._io.fileno()

    def close(self) -> None:
        self._io.close()
