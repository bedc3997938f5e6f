"""The decode side's ZeroMQ I/O thread: one connection per prefill peer (``zmq_io.py`` runs it).

It owns every socket of the decode side and never touches the KV pool. On a ``request``
command it connects to the peer named (a DEALER socket, opened on first use with a HELLO that
carries this side's KV layout) and holds the request in the peer's backlog until the peer's
WELCOME, whose layout must match, else the peer is dropped. ``notify`` goes only to a peer
already connected, never opening a connection to say it (a notice about a request still in
the backlog takes the request out instead); ``check`` connects and resolves its future with
the peer's layout once welcomed. Every tick it retries a HELLO ZeroMQ could not queue,
pings welcomed peers every ``heartbeat_interval``, and drops a peer that did not answer the
handshake, or stayed silent, for ``heartbeat_timeout``.

What it hands the engine thread, as events (``drain``): ``("data", endpoint, header, k, v)``
with the frames unread, ``("abort", transfer id bytes, reason)``, and ``("peer_failed",
endpoint, reason, kind)`` when a peer is dropped (``kind``: connect, handshake, layout,
peer_lost, sealed); a dropped peer's pending ``check`` futures fail with the same reason.

With keys (``sealed``), the HELLO carries this side's share of a key agreement, the WELCOME
names a second, plain port, and the KV arrives there sealed (``zmq_sealed.py``): a message
that fails its seal drops the peer and is counted in ``refused``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.disagg import wire
from radixserve.disagg.transfer import KVLayout, LayoutMismatchError, TransferError
from radixserve.disagg.zmq_io import IOThread, log
from radixserve.disagg.zmq_sealed import DataLink
from radixserve.links.keys import ZmqSecurity, split_endpoint
from radixserve.links.sealed import SealError


@dataclass
class PeerConn:
    sock: zmq.Socket
    opened: float
    last_heard: float
    last_ping: float = 0.0
    layout: KVLayout | None = None  # set by WELCOME
    data: DataLink | None = None  # the sealed data connection, with keys
    hello: list[bytes] | None = None  # the HELLO, until ZeroMQ took it
    backlog: list[list[Any]] = field(default_factory=list)
    waiters: list[Future] = field(default_factory=list)


class ReceiverIO(IOThread):
    def __init__(
        self, layout: KVLayout, security: ZmqSecurity, sealed: bool, heartbeat_interval: float,
        heartbeat_timeout: float,
    ):  # fmt: skip
        super().__init__("radixserve-kv-receiver", heartbeat_interval, heartbeat_timeout)
        self.layout = layout
        self.security = security
        self.sealed = sealed and security.public_key is not None
        self.conns: dict[str, PeerConn] = {}
        self.endpoint_of: dict[zmq.Socket, str] = {}
        self.refused = 0  # messages on sealed data connections that failed their seal
        self._logged: set[str] = set()

    def setup(self) -> None:
        pass  # sockets open on demand, one per prefill peer

    def _connect(self, endpoint: str) -> PeerConn | None:
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
        conn = self.conns[endpoint] = PeerConn(sock, opened=now, last_heard=now)
        self.endpoint_of[sock] = endpoint
        self.poller.register(sock, zmq.POLLIN)
        hello = {"version": wire.PROTOCOL_VERSION, "layout": self.layout.to_dict()}
        if self.sealed:
            conn.data = DataLink()
            hello["share"] = conn.data.share.hex()
        conn.hello = [wire.HELLO, wire.pack_json(hello)]
        self._send_hello(conn)
        return conn

    def _send_hello(self, conn: PeerConn) -> None:
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

    def _on_sealed(self, endpoint: str, conn: PeerConn, frames: list[zmq.Frame]) -> None:
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

    def _welcome(self, endpoint: str, conn: PeerConn, body: list[zmq.Frame]) -> None:
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
