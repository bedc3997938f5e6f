"""The prefill side of the ZeroMQ KV transfer (see ``transfer.py`` for the contract and
``wire.py`` for the messages).

A ROUTER socket, bound on a TCP port, serves every decode instance that connects. The
handshake compares KV layouts and answers WELCOME or REJECT (naming what differs); requests
from a peer that has not passed it are refused, which is also what a decode instance sees
after this process restarted. A peer silent for ``heartbeat_timeout`` is dead: its transfers
end FAILED (``finished``), so the engine can abort their prefills and free their slots.

With CurveZMQ keys (``security``) only decode instances holding an allowed key get through
the socket's guard: no other client can ask for KV or say anything at all; ``endpoint``
then carries this instance's public key (``tcp://HOST:PORT?curve=KEY``, ``links/keys.py``),
so whoever is told the endpoint knows whom to expect there. With keys, the KV itself (DATA)
goes over a second, plain port under AES-256-GCM with per-connection keys agreed over
CurveZMQ (``zmq_sealed.py``), bound on the same interface (``data_port``, any free one by
default) and named to each decode instance in its WELCOME.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import torch
import zmq

from radixserve.cache.kv_pool import KVPool
from radixserve.disagg import wire
from radixserve.disagg.transfer import (
    KVLayout,
    KVSender,
    TransferError,
    TransferRequest,
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
from radixserve.disagg.zmq_sealed import SEALED, DataRoutes
from radixserve.links.guard import start_guard
from radixserve.links.keys import ZmqSecurity, join_endpoint
from radixserve.links.sealed import SealError

DEFAULT_MESSAGE_BYTES = 4 << 20  # K (and V) frame size a DATA message aims at


class _SenderIO(IOThread):
    def __init__(
        self, layout: KVLayout, bind: tuple[str, int, int | None], security: ZmqSecurity,
        heartbeat_interval, heartbeat_timeout,
    ):  # fmt: skip
        super().__init__("radixserve-kv-sender", heartbeat_interval, heartbeat_timeout)
        self.layout = layout
        # where to bind, the data port to bind (0: any free one), the data port decode
        # instances are told (None: the bound one; else a port forwarded to it)
        self.bind = bind
        self.security = security
        self.endpoint = ""
        self.last_heard: dict[bytes, float] = {}  # welcomed peers
        self.routes: DataRoutes | None = None  # the sealed data port, with keys
        self._logged: set[str] = set()

    def setup(self) -> None:
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop a DATA message to a slow peer
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.guard = start_guard(self.ctx, self.security, "KV transfer")
        self.security.server(self.sock)
        main_bind, data_port, _ = self.bind
        self.sock.bind(main_bind)
        self.guard.watch(self.sock)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller.register(self.sock, zmq.POLLIN)
        if self.security.public_key is not None:  # CurveZMQ: the KV goes sealed, beside it
            data_bind = f"{main_bind.rsplit(':', 1)[0]}:{data_port or '*'}"
            self.routes = DataRoutes(self.ctx, data_bind)
            self.poller.register(self.routes.sock, zmq.POLLIN)

    def on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        if self.routes is not None and sock is self.routes.sock:
            why = self.routes.on_message(frames)
            if why is not None and SEALED not in self._logged:
                self._logged.add(SEALED)
                log.warning(
                    "KV sender: refused a message on the sealed data port (%s); further "
                    "ones are only counted (/metrics)", why,
                )  # fmt: skip
            return
        peer, kind, body = frames[0].bytes, frames[1].bytes, frames[2:]
        if kind == wire.HELLO:
            self._handshake(peer, body)
            return
        if peer not in self.last_heard:
            self._send(peer, wire.REJECT, b"no handshake with this instance: connect again")
            return
        self.last_heard[peer] = time.monotonic()
        try:
            if kind == wire.PING:
                self._send(peer, wire.PONG)
            elif kind == wire.REQ:
                tid, head, blob = body[0].bytes, wire.unpack_json(body[1].bytes), body[2].bytes
                self.post("req", peer, tid, int(head["num_tokens"]), head.get("meta", {}), blob)
            elif kind == wire.DONE:
                self.post("ended", body[0].bytes, TransferState.DONE, None, None)
            elif kind in (wire.CANCEL, wire.FAIL):
                what = "cancelled" if kind == wire.CANCEL else "failed"
                reason = f"the decode instance {what} it: {wire.text(body[1].bytes)}"
                self.post("ended", body[0].bytes, TransferState.FAILED, reason, what)
        except (IndexError, KeyError, ValueError, TransferError) as e:
            log.warning("KV sender: a malformed %r message from a peer: %s", kind, e)

    def _handshake(self, peer: bytes, body: list[zmq.Frame]) -> None:
        try:
            hello = wire.unpack_json(body[0].bytes)
            theirs = KVLayout.from_dict(hello["layout"])
            version = hello["version"]
        except (IndexError, KeyError, TypeError, TransferError) as e:
            self._send(peer, wire.REJECT, f"malformed handshake: {e}".encode())
            return
        if version != wire.PROTOCOL_VERSION:
            reason = f"protocol version {version} there, {wire.PROTOCOL_VERSION} here"
        elif diffs := theirs.mismatch(self.layout):
            reason = "KV layouts differ (decode vs prefill): " + "; ".join(diffs)
        else:
            welcome = {"layout": self.layout.to_dict()}
            now = time.monotonic()
            if self.routes is not None:
                try:
                    welcome |= self.routes.open(peer, hello, now, self.bind[2])
                except SealError as e:
                    self._send(peer, wire.REJECT, f"malformed handshake: {e}".encode())
                    return
            self.last_heard[peer] = now
            self._send(peer, wire.WELCOME, wire.pack_json(welcome))
            return
        log.warning("KV sender: refused a decode instance: %s", reason)
        self._send(peer, wire.REJECT, reason.encode())

    def _send(self, peer: bytes, *frames) -> None:
        self.sock.send_multipart([peer, *frames], copy=False)

    def on_command(self, cmd: tuple) -> None:
        if cmd[0] == "send":
            _, peer, frames = cmd
            if peer not in self.last_heard:
                return  # a dead peer's data goes nowhere
            kind, *rest = frames
            if kind == wire.DATA and self.routes is not None:
                if self.routes.send(peer, kind, rest[0], rest[1:]):
                    return
            self._send(peer, *frames)

    def on_tick(self, now: float) -> None:
        unbound = self.routes.unbound(now - self.heartbeat_timeout) if self.routes else []
        for peer, heard in list(self.last_heard.items()):
            if peer in unbound:  # alive, but its KV would have nowhere to go
                reason = (
                    f"no sealed KV connection reached data port {self.routes.port} in "
                    f"{self.heartbeat_timeout:.1f} s (is it reachable? --kv-transfer-data-port)"
                )
                self._send(peer, wire.REJECT, reason.encode())
            elif now - heard > self.heartbeat_timeout:
                reason = (
                    f"the decode instance went silent ({now - heard:.1f} s without a heartbeat)"
                )
            else:
                continue
            del self.last_heard[peer]
            self.post("peer_lost", peer, reason)
            if self.routes is not None:
                self.routes.drop(peer)


@dataclass
class _Outbound:
    peer: bytes
    num_tokens: int
    pushed: int = 0


class ZmqKVSender(KVSender):
    def __init__(
        self,
        pool: KVPool,
        layout: KVLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        security: ZmqSecurity,
        advertise_host: str | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        message_bytes: int = DEFAULT_MESSAGE_BYTES,
        data_port: int = 0,
        advertise_data_port: int | None = None,
    ):
        self.pool, self.layout = pool, layout
        self.message_bytes = message_bytes
        self.stats = TransferStats()
        bind = (f"tcp://{host}:{port if port else '*'}", data_port, advertise_data_port)
        self._io = _SenderIO(layout, bind, security, heartbeat_interval, heartbeat_timeout)
        self._io.start()
        endpoint = self._io.endpoint
        if advertise_host:
            endpoint = f"tcp://{advertise_host}:{endpoint.rsplit(':', 1)[1]}"
        self.endpoint = join_endpoint(endpoint, security.public_key)
        # the sealed data port as bound (None: plain sockets, the KV goes with the rest)
        self.data_port = self._io.routes.port if self._io.routes is not None else None
        self._outbound: dict[str, _Outbound] = {}
        self._new: list[TransferRequest] = []
        self._ended: list[tuple[str, TransferStatus]] = []

    def _drain(self) -> None:
        for event in self._io.drain():
            kind = event[0]
            if kind == "req":
                _, peer, tid, num_tokens, meta, blob = event
                key = uuid.UUID(bytes=tid).hex
                if num_tokens < 1:
                    self._io.command("send", peer, [wire.ABORT, tid, b"a transfer of no tokens"])
                    continue
                self._outbound[key] = _Outbound(peer, num_tokens)
                self._new.append(TransferRequest(key, num_tokens, meta, blob, peer.hex()))
            elif kind == "ended":
                _, tid, state, reason, failure = event
                self._end(uuid.UUID(bytes=tid).hex, state, reason, failure)
            elif kind == "peer_lost":
                _, peer, reason = event
                for key in [k for k, ob in self._outbound.items() if ob.peer == peer]:
                    self._end(key, TransferState.FAILED, reason, "peer_lost")

    def _end(self, key: str, state: TransferState, reason: str | None, failure: str | None):
        ob = self._outbound.pop(key, None)
        if ob is None:
            return  # already aborted here
        if state is TransferState.DONE:
            self.stats.transfers_done += 1
        else:
            self.stats.count_failure(failure or "failed")
        done = ob.pushed * self.layout.bytes_per_token()
        self._ended.append((key, TransferStatus(state, reason, ob.pushed, done)))

    def incoming(self) -> list[TransferRequest]:
        self._drain()
        new, self._new = self._new, []
        return new

    def finished(self) -> list[tuple[str, TransferStatus]]:
        self._drain()
        ended, self._ended = self._ended, []
        return ended

    def push(self, transfer_id: str, src_slots: torch.Tensor) -> None:
        ob = self._outbound.get(transfer_id)
        if ob is None:
            raise TransferError(f"transfer {transfer_id} is unknown or has ended")
        n = len(src_slots)
        if ob.pushed + n > ob.num_tokens:
            raise TransferError(
                f"transfer {transfer_id}: pushing tokens {ob.pushed}..{ob.pushed + n} "
                f"past its length {ob.num_tokens}"
            )
        tid = uuid.UUID(transfer_id).bytes
        per_token = self.layout.bytes_per_token_layer()
        piece = max(1, self.message_bytes // per_token)  # tokens per message, one layer each
        for start in range(0, n, piece):
            slots = src_slots[start : start + piece]
            for lo, hi in wire.layer_groups(self.layout, len(slots), self.message_bytes):
                k, v = wire.gather(self.pool, slots, lo, hi)
                header = wire.DataHeader(tid, ob.pushed + start, len(slots), lo, hi)
                self._io.command("send", ob.peer, [wire.DATA, header.pack(), k, v])
        ob.pushed += n
        self.stats.tokens += n
        self.stats.bytes += n * self.layout.bytes_per_token()

    def abort(self, transfer_id: str, reason: str) -> None:
        ob = self._outbound.pop(transfer_id, None)
        if ob is not None:
            tid = uuid.UUID(transfer_id).bytes
            self._io.command("send", ob.peer, [wire.ABORT, tid, reason.encode()])
            self.stats.count_failure("aborted")

    def fileno(self) -> int:
        return self._io.fileno()

    def refused(self) -> dict[str, int]:
        """Connections turned away so far, by reason (``links/guard.py``), and messages on
        the sealed data port that failed their seal (``sealed``)."""
        refused = self._io.guard.refused()
        if self._io.routes is not None and self._io.routes.refused:
            refused[SEALED] = self._io.routes.refused
        return refused

    def close(self) -> None:
        self._io.close()
