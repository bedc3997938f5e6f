"""The gate of one ZeroMQ context's server sockets: admits CurveZMQ clients by key (ZAP) and
counts the connections turned away.

libzmq asks the context's ZAP handler (``inproc://zeromq.zap.01``) about every client that
completed the CurveZMQ handshake, with the client's public key; the guard answers 200 for a
key the process's ``CurveKeys`` accept and 400 otherwise, so such a client gets nothing: no
message reaches the socket's owner. Connections that never get that far (a plain client,
a client with another server key, bytes that are not ZeroMQ, a handshake cut short or too
slow) are refused by libzmq itself; the guard learns of all of them from the sockets'
monitors. ``refused()`` counts them by reason:

- ``key``: the handshake passed but the key is not allowed;
- ``protocol``: not CurveZMQ with this server's key (plain ZeroMQ, another server key, garbage);
- ``handshake``: the peer left, or stalled, before the handshake ended.

Each refused address is logged once (ZAP tells the address; libzmq's monitor does not, so a
refusal it alone sees is logged once per reason). A ``PLAIN`` process has no guard: its
sockets admit everyone, which is what ``--zmq-unauthenticated`` says.

One thread per guard owns the ZAP socket and the monitor sockets (handed over by the threads
that own the watched sockets) and does nothing else.
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from radixserve.links.keys import CurveKeys, ZmqSecurity

log = logging.getLogger("radixserve.links")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake",
}
WHY = {
    "protocol": "not CurveZMQ with this instance's server key (a plain client, a client "
    "expecting another server key, or bytes that are not ZeroMQ)",
    "handshake": "the peer left or stalled before the CurveZMQ handshake ended",
}
MAX_LOGGED_PEERS = 4096  # past this many refused addresses, new ones are counted only
POLL_MS = 100  # how soon a new monitor or a stop is noticed


class LinkGuard:
    def __init__(self, ctx: zmq.Context, keys: CurveKeys, link: str):
        self.keys, self.link = keys, link
        self._counts: dict[str, int] = {}
        self._logged: set[object] = set()
        self._new: queue.SimpleQueue[zmq.Socket] = queue.SimpleQueue()
        self._stop = threading.Event()
        # bound now, before any server socket of the context can take a connection
        self._zap = ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name=f"zap-{link}", daemon=True)
        self._thread.start()

    def watch(self, sock: zmq.Socket) -> None:
        """Count ``sock``'s refused connections; call from the thread that owns ``sock``."""
        events = 0
        for event in REFUSALS:
            events |= event
        self._new.put(sock.get_monitor_socket(events))

    def refused(self) -> dict[str, int]:
        return dict(self._counts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # ---------------------------------------------------------------- guard thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: list[zmq.Socket] = []
        try:
            while not self._stop.is_set():
                while not self._new.empty():
                    monitors.append(self._new.get())
                    poller.register(monitors[-1], zmq.POLLIN)
                for sock, _ in poller.poll(POLL_MS):
                    if sock is self._zap:
                        self._answer(sock.recv_multipart())
                    else:
                        self._event(parse_monitor_message(sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            # monitors handed over after the last poll are still this thread's to close: an
            # open one would hold the context's term() forever
            while not self._new.empty():
                monitors.append(self._new.get())
            for sock in [self._zap, *monitors]:
                sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        """One ZAP request: version, id, domain, address, identity, mechanism, credentials."""
        if len(frames) < 6:
            return  # not a ZAP request; libzmq never sends one
        version, request_id, _, address, _, mechanism, *credentials = frames
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else None
        if key is not None and self.keys.accepts(key):
            self._zap.send_multipart([version, request_id, b"200", b"OK", key, b""])
            return
        self._zap.send_multipart([version, request_id, b"400", b"key not allowed", b"", b""])
        peer = address.decode(errors="replace")
        if peer not in self._logged and len(self._logged) < MAX_LOGGED_PEERS:
            self._logged.add(peer)
            log.warning(
                "%s: refused a client at %s whose key %s is not allowed (--zmq-allow); "
                "further refusals from there are only counted (/metrics)",
                self.link, peer, key.decode() if key else f"({mechanism.decode()})",
            )  # fmt: skip

    def _event(self, event: dict) -> None:
        reason = REFUSALS.get(event["event"])
        if reason is None:
            return
        self._counts[reason] = self._counts.get(reason, 0) + 1
        if reason != "key" and reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "%s: turned a connection away: %s; further ones are only counted (/metrics)",
                self.link, WHY[reason],
            )  # fmt: skip


class NoGuard:
    """The guard of plain sockets: no gate, nothing refused."""

    def watch(self, sock: zmq.Socket) -> None:
        pass

    def refused(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def start_guard(ctx: zmq.Context, security: ZmqSecurity, link: str) -> LinkGuard | NoGuard:
    """The guard of ``ctx``'s server sockets, started before any of them binds."""
    return LinkGuard(ctx, security, link) if isinstance(security, CurveKeys) else NoGuard()
