"""The sealed data connection of a KV transfer link with CurveZMQ keys.

CurveZMQ's own cipher runs single-threaded in libzmq's I/O thread and would set the rate of
a KV transfer; so with keys, the DATA messages (the KV itself) travel over a second, plain
ZeroMQ connection, each sealed with AES-256-GCM under keys agreed over the CurveZMQ one
(``links/sealed.py``: key schedule, nonces, what is authenticated). Everything else (the
handshake, requests with their token ids, heartbeats, aborts) stays on CurveZMQ.

Agreement and binding, in the handshake (``wire.py``)::

    decode -> prefill (CurveZMQ)   HELLO   {..., share: client share}
    prefill -> decode (CurveZMQ)   WELCOME {..., share: server share, session: id, data_port}
    decode -> prefill (data port)  BIND    session  seq  sealed(b"")

The prefill instance binds the data port with plain ZeroMQ, so anyone who reaches it may
connect; what reaches it is a BIND only, and only one sealed with the session's key, with a
sequence number never seen, ties the connection to its session (``DataRoutes``): a client
without the key, or one replaying a BIND it saw, gets nothing and is counted
(``refused["sealed"]``). DATA for a session waits until its BIND arrived.

The decode instance opens its data connection only to the port the authenticated WELCOME
named (``DataLink``), and takes nothing there but DATA that opens under the session's key in
sending order; anything else (tampered, replayed, reordered, forged) means the connection is
not what it should be: the link drops it, and its transfers fail before a byte of that
message reaches the pool.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.links.sealed import Opener, Sealer, SealError, SessionKeys, new_share

BIND = b"BIND"
DATA = b"DATA"  # as in wire.py, which the data connection carries no other kind of
SEALED = "sealed"  # the refusal reason: a message that failed its seal


def _hex_field(d: dict, name: str, size: int) -> bytes:
    try:
        raw = bytes.fromhex(d[name])
    except (KeyError, TypeError, ValueError) as e:
        raise SealError(f"no valid {name!r} in the handshake ({e})") from None
    if len(raw) != size:
        raise SealError(f"{name!r} of {len(raw)} bytes, expected {size}")
    return raw


@dataclass
class _Session:
    id: bytes
    sealer: Sealer
    opener: Opener
    opened: float
    route: bytes | None = None  # the data connection, once its BIND passed
    pending: list[list[Any]] = field(default_factory=list)


class DataRoutes:
    """The prefill side: the plain data socket and one session per decode peer."""

    def __init__(self, ctx: zmq.Context, bind: str):
        self.sock = ctx.socket(zmq.ROUTER)
        for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            self.sock.setsockopt(opt, 0)
        self.sock.bind(bind)
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.refused = 0
        self._by_peer: dict[bytes, _Session] = {}
        self._by_id: dict[bytes, bytes] = {}

    def open(self, peer: bytes, hello: dict, now: float, advertise_port: int | None) -> dict:
        """A session for ``peer`` from its HELLO; the fields its WELCOME adds (none when the
        peer asked for no sealed connection). ``SealError`` for a malformed share."""
        self.drop(peer)
        if "share" not in hello:
            return {}
        client_share = _hex_field(hello, "share", len(new_share()))
        server_share = new_share()
        keys = SessionKeys.derive(client_share, server_share, client=False)
        sid = uuid.uuid4().bytes
        self._by_peer[peer] = _Session(sid, Sealer(keys.send), Opener(keys.receive), now)
        self._by_id[sid] = peer
        port = advertise_port or self.port
        return {"share": server_share.hex(), "session": sid.hex(), "data_port": port}

    def send(self, peer: bytes, kind: bytes, header: bytes, payloads: list[Any]) -> bool:
        """Seal and send (or queue until BIND) a message to ``peer``; False: no session."""
        s = self._by_peer.get(peer)
        if s is None:
            return False
        frames = [kind, header, *s.sealer.seal(kind, header, payloads)]
        if s.route is None:
            s.pending.append(frames)
        else:
            self.sock.send_multipart([s.route, *frames], copy=False)
        return True

    def on_message(self, frames: list[zmq.Frame]) -> str | None:
        """A message on the data socket; why it was refused, or None."""
        try:
            route, kind, sid, seq, *sealed = (f.bytes for f in frames)
            if kind != BIND:
                raise SealError(f"a {kind[:16]!r} message on the data port")
            s = self._by_peer.get(self._by_id.get(sid, b""))
            if s is None:
                raise SealError("a BIND for no open session")
            s.opener.open(BIND, sid, seq, sealed)
        except ValueError as e:  # SealError, or too few frames
            self.refused += 1
            return str(e)
        s.route = route  # the latest authentic BIND wins: a decode instance that reconnected
        for pending in s.pending:
            self.sock.send_multipart([route, *pending], copy=False)
        s.pending.clear()
        return None

    def unbound(self, older_than: float) -> list[bytes]:
        """Peers whose session opened before ``older_than`` and is still not bound."""
        return [p for p, s in self._by_peer.items() if s.route is None and s.opened < older_than]

    def drop(self, peer: bytes) -> None:
        s = self._by_peer.pop(peer, None)
        if s is not None:
            self._by_id.pop(s.id, None)


class DataLink:
    """The decode side of one prefill peer's sealed data connection."""

    def __init__(self):
        self.share = new_share()
        self.sock: zmq.Socket | None = None
        self._opener: Opener | None = None

    def connect(self, ctx: zmq.Context, address: str, welcome: dict) -> zmq.Socket | None:
        """Open the data connection the WELCOME names (None: it names none, so DATA comes
        over CurveZMQ); ``SealError`` for a malformed WELCOME."""
        if "session" not in welcome:
            return None
        server_share = _hex_field(welcome, "share", len(self.share))
        sid = _hex_field(welcome, "session", 16)
        port = welcome.get("data_port")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise SealError(f"a data port of {port!r}")
        keys = SessionKeys.derive(self.share, server_share, client=True)
        self._opener = Opener(keys.receive)
        sock = self.sock = ctx.socket(zmq.DEALER)
        for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(opt, 0)
        # the same identity after ZeroMQ reconnects a dropped TCP connection, so the route
        # its BIND set still reaches it (the id was secret until this connection's BIND)
        sock.setsockopt(zmq.ROUTING_ID, sid)
        sock.connect(f"{address.rsplit(':', 1)[0]}:{port}")
        try:  # never blocks: a fresh connection queues it, unless the port refused ZeroMQ
            bind = [BIND, sid, *Sealer(keys.send).seal(BIND, sid, [b""])]
            sock.send_multipart(bind, flags=zmq.DONTWAIT)
        except zmq.Again:
            raise SealError(f"the data port {port} refused the connection") from None
        return sock

    def open(self, frames: list[zmq.Frame]) -> tuple[bytes, Any, Any]:
        """A DATA message's header, K and V, or ``SealError``."""
        if self._opener is None or len(frames) != 5:
            raise SealError(f"a message of {len(frames)} frames on the data connection")
        kind, header = frames[0].bytes, frames[1].bytes
        if kind != DATA:
            raise SealError(f"a {kind[:16]!r} message on the data connection")
        k, v = self._opener.open(
            kind, header, frames[2].bytes, [frames[3].buffer, frames[4].buffer]
        )
        return header, k, v

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
