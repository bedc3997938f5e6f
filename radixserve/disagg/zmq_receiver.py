"""The decode side of the ZeroMQ KV transfer (see ``transfer.py`` for the contract and
``wire.py`` for the messages).

One DEALER socket per prefill peer, opened on first use with a handshake; requests wait in a
backlog until the peer's WELCOME. Pings go out every ``heartbeat_interval``; a peer that does
not answer the handshake, or stays silent, within ``heartbeat_timeout`` is dropped and its
transfers fail (the next request to it connects afresh). DATA frames are handed, unread, to
the engine thread, which lands them in the pool inside ``progress``: per layer, token ranges
must arrive in order and fit the transfer, else it fails and the peer is told to stop.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from radixserve.cache.kv_pool import KVPool
from radixserve.disagg import wire
from radixserve.disagg.transfer import (
    KVLayout,
    KVReceiver,
    LayoutMismatchError,
    TransferError,
    TransferState,
    TransferStats,
    TransferStatus,
)
from radixserve.disagg.zmq_io import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    IOThread,
    log,
)
from radixserve.disagg.zmq_sealed import SEALED, DataLink
from radixserve.links.keys import ZmqSecurity, split_endpoint
from radixserve.links.sealed import SealError


@dataclass
class _Conn:
    sock: zmq.Socket
    opened: float
    last_heard: float
    last_ping: float = 0.0
    layout: KVLayout | None = None  # set by WELCOME
    data: DataLink | None = None  # the sealed data connection, with keys
    hello: list[bytes] | None = None  # the HELLO, until ZeroMQ took it
    backlog: list[list[Any]] = field(default_factory=list)
    waiters: list[Future] = field(default_factory=list)


class _ReceiverIO(IOThread):
    def __init__(
        self, layout: KVLayout, security: ZmqSecurity, sealed: bool, heartbeat_interval: float,
        heartbeat_timeout: float,
    ):  # fmt: skip
        super().__init__("radixserve-kv-receiver", heartbeat_interval, heartbeat_timeout)
        self.layout = layout
        self.security = security
        self.sealed = sealed and security.public_key is not None
        self.conns: dict[str, _Conn] = {}
        self.endpoint_of: dict[zmq.Socket, str] = {}
        self.refused = 0  # messages on sealed data connections that failed their seal
        self._logged: set[str] = set()

    def setup(self) -> None:
        pass  # sockets open on demand, one per prefill peer

    def _connect(self, endpoint: str) -> _Conn | None:
        conn = self.conns.get(endpoint)
        if conn is not None:
            return conn
        sock = self.ctx.socket(zmq.DEALER)
        for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(opt, 0)
        try:
            address, server_key = split_endpoint(endpoint)
            self.security.client(sock, server_key)
            sock.connect(address)
        except (zmq.ZMQError, ValueError) as e:
            sock.close(0)
            self.post("peer_failed", endpoint, f"cannot connect to {endpoint!r}: {e}", "connect")
            return None
        now = time.monotonic()
        conn = self.conns[endpoint] = _Conn(sock, opened=now, last_heard=now)
        self.endpoint_of[sock] = endpoint
        self.poller.register(sock, zmq.POLLIN)
        hello = {"version": wire.PROTOCOL_VERSION, "layout": self.layout.to_dict()}
        if self.sealed:
            conn.data = DataLink()
            hello["share"] = conn.data.share.hex()
        conn.hello = [wire.HELLO, wire.pack_json(hello)]
        self._send_hello(conn)
        return conn

    def _send_hello(self, conn: _Conn) -> None:
        """Without blocking: once the peer refused ZeroMQ's own handshake (another key, no
        CurveZMQ) the socket has nowhere to queue a message until it reconnects, and a
        blocked send would stop this thread, every peer's traffic and its own close."""
        try:
            conn.sock.send_multipart(conn.hello, flags=zmq.DONTWAIT)
            conn.hello = None
        except zmq.Again:
            pass  # again on the next tick, until the handshake timeout

    def _drop(self, endpoint: str, reason: str, kind: str) -> None:
        conn = self.conns.pop(endpoint)
        for sock in (conn.sock, conn.data and conn.data.sock):
            if sock is not None and self.endpoint_of.pop(sock, None) is not None:
                self.poller.unregister(sock)
        conn.sock.close(0)
        if conn.data is not None:
            conn.data.close()
        error = LayoutMismatchError if kind == "layout" else TransferError
        for fut in conn.waiters:
            fut.set_exception(error(reason))
        self.post("peer_failed", endpoint, reason, kind)

    def on_command(self, cmd: tuple) -> None:
        kind, endpoint = cmd[0], cmd[1]
        if kind == "request":  # connect if needed; queue until the handshake passed
            conn = self._connect(endpoint)
            if conn is not None and conn.layout is None:
                conn.backlog.append(cmd[2])
            elif conn is not None:
                conn.sock.send_multipart(cmd[2], copy=False)
        elif kind == "notify":  # only to a live peer: never reconnect just to say it
            conn = self.conns.get(endpoint)
            if conn is None:
                return
            if conn.layout is not None:
                conn.sock.send_multipart(cmd[2], copy=False)
                return
            # Handshake pending: a request still in the backlog need not go at all.
            tid = cmd[2][1]
            unsent = [f for f in conn.backlog if f[0] == wire.REQ and f[1] == tid]
            if unsent:
                conn.backlog.remove(unsent[0])
            else:
                conn.backlog.append(cmd[2])
        elif kind == "check":
            conn = self._connect(endpoint)
            if conn is None:
                cmd[2].set_exception(TransferError(f"cannot connect to {endpoint!r}"))
            elif conn.layout is not None:
                cmd[2].set_result(conn.layout)
            else:
                conn.waiters.append(cmd[2])

    def on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        endpoint = self.endpoint_of[sock]
        conn = self.conns[endpoint]
        if conn.data is not None and sock is conn.data.sock:
            self._on_sealed(endpoint, conn, frames)
            return
        conn.last_heard = time.monotonic()
        kind, body = frames[0].bytes, frames[1:]
        if kind == wire.DATA:
            if len(body) == 3:
                self.post("data", endpoint, body[0].bytes, body[1].buffer, body[2].buffer)
        elif kind == wire.ABORT:
            self.post("abort", body[0].bytes, wire.text(body[1].bytes))
        elif kind == wire.WELCOME:
            self._welcome(endpoint, conn, body)
        elif kind == wire.REJECT:
            reason = f"prefill instance {endpoint} refused the handshake: "
            reason += wire.text(body[0].bytes)
            self._drop(endpoint, reason, "layout" if "layouts differ" in reason else "handshake")

    def _on_sealed(self, endpoint: str, conn: _Conn, frames: list[zmq.Frame]) -> None:
        """A message on the sealed data connection: DATA that opens, or the end of it."""
        try:
            header, k, v = conn.data.open(frames)
        except SealError as e:
            self.refused += 1
            reason = (
                f"a KV message from prefill instance {endpoint} failed its authentication "
                f"({e}): the data connection was tampered with; dropped it"
            )
            if endpoint not in self._logged:
                self._logged.add(endpoint)
                log.warning("KV receiver: %s; further ones are only counted (/metrics)", reason)
            self._drop(endpoint, reason, "sealed")
            return
        conn.last_heard = time.monotonic()
        self.post("data", endpoint, header, k, v)

    def _welcome(self, endpoint: str, conn: _Conn, body: list[zmq.Frame]) -> None:
        try:
            welcome = wire.unpack_json(body[0].bytes)
            theirs = KVLayout.from_dict(welcome["layout"])
            if conn.data is not None:
                address = split_endpoint(endpoint)[0]
                data_sock = conn.data.connect(self.ctx, address, welcome)
                if data_sock is not None:
                    self.endpoint_of[data_sock] = endpoint
                    self.poller.register(data_sock, zmq.POLLIN)
        except (IndexError, KeyError, TypeError, TransferError, SealError, zmq.ZMQError) as e:
            self._drop(endpoint, f"malformed handshake answer from {endpoint}: {e}", "handshake")
            return
        if diffs := self.layout.mismatch(theirs):
            reason = "KV layouts differ (decode vs prefill): " + "; ".join(diffs)
            self._drop(endpoint, reason, "layout")
            return
        conn.layout = theirs
        for frames in conn.backlog:
            conn.sock.send_multipart(frames, copy=False)
        conn.backlog.clear()
        for fut in conn.waiters:
            fut.set_result(theirs)
        conn.waiters.clear()

    def on_tick(self, now: float) -> None:
        for endpoint, conn in list(self.conns.items()):
            if conn.hello is not None:
                self._send_hello(conn)
            if conn.layout is None and now - conn.opened > self.heartbeat_timeout:
                reason = (
                    f"no handshake answer from {endpoint} in {self.heartbeat_timeout:.1f} s "
                    "(is a prefill instance listening there, with the ZeroMQ keys expected?)"
                )
                self._drop(endpoint, reason, "connect")
            elif now - conn.last_heard > self.heartbeat_timeout:
                silent = now - conn.last_heard
                reason = f"prefill instance {endpoint} went silent ({silent:.1f} s)"
                self._drop(endpoint, reason, "peer_lost")
            elif conn.layout is not None and now - conn.last_ping >= self.heartbeat_interval:
                conn.sock.send(wire.PING)
                conn.last_ping = now


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
        self._io = _ReceiverIO(layout, security, sealed_data, *beat)
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
