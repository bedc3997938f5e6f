"""The KV-event publisher of an engine process: ZeroMQ XPUB + a replay/dump ROUTER socket.

A background thread owns both sockets; the engine thread only hands it lists of events (a
queue put) and reads two flags, so publishing never blocks a step: XPUB drops messages for a
subscriber past its high-water mark (the subscriber sees a gap in sequence numbers and asks
for a replay) instead of waiting.

XPUB tells us about subscriptions, so the engine builds events only while someone listens:
``subscribed`` turns True at the first subscription and False when the last subscriber
leaves; with no subscriber the engine does no hashing at all. ``dump_requests`` are answered
by the engine thread (only it may walk the tree) through ``send_dump``; queued after every
batch published before it, a dump is stamped with the last sequence number sent, and has at
least one message (an empty batch for an empty tree) so the stamp always arrives.

Wire format and the replay/dump protocol: ``wire.py``. Endpoints: ``tcp://HOST:PORT`` (port 0
picks a free port; ``endpoints`` gives the bound addresses), ``ipc://PATH``, ``inproc://NAME``.
Both sockets take the process's ``security`` (``links/keys.py``): with CurveZMQ keys only
clients whose key is allowed connect (``refused()`` counts the others, ``links/guard.py``);
``PLAIN`` sockets admit anyone.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence

import zmq

from radixserve.kvevents.types import EventBatch, KVEvent
from radixserve.kvevents.wire import (
    DUMP_REQUEST,
    END_SEQ,
    encode_batch,
    seq_bytes,
    seq_from_bytes,
)
from radixserve.links.guard import start_guard
from radixserve.links.keys import ZmqSecurity

log = logging.getLogger("radixserve")
DUMP_EVENTS_PER_MESSAGE = 256


def bindable(endpoint: str) -> str:
    """ZeroMQ spells "any free port" as ``*``; accept the usual ``:0`` too."""
    return (
        endpoint[:-2] + ":*"
        if endpoint.startswith("tcp://") and endpoint.endswith(":0")
        else endpoint
    )


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        security: ZmqSecurity,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        topic: str = "",
        data_parallel_rank: int | None = None,
    ):
        self._ctx = zmq.Context()
        self.security = security
        self._guard = start_guard(self._ctx, security, "KV events")
        self._requested = (endpoint, replay_endpoint)
        self._hwm = hwm
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._last_seq = -1
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._dumps: collections.deque[bytes] = collections.deque()
        self._topics: set[bytes] = set()
        self.subscribed = False
        self.endpoints: tuple[str, str | None] = (endpoint, replay_endpoint)
        self.published_batches = 0
        # the engine thread pokes the publisher thread through this pair
        self._wake_addr = f"inproc://kv-events-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    # ------------------------------------------------------------------ engine thread
    def start(self, timeout: float = 10.0) -> tuple[str, str | None]:
        """Bind both sockets (in the publisher thread); return the bound endpoints."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the KV event publisher did not start")
        if self._error is not None:
            raise OSError(f"cannot bind the KV event sockets {self._requested}: {self._error}")
        return self.endpoints

    def publish(self, events: Sequence[KVEvent]) -> None:
        if events:
            self._out.put(("batch", time.time(), list(events)))
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # wake-ups are queued already: the thread is about to drain

    def take_dump_requests(self) -> list[bytes]:
        out = []
        while self._dumps:
            out.append(self._dumps.popleft())
        return out

    def send_dump(self, client: bytes, events: Sequence[KVEvent]) -> None:
        self._out.put(("dump", client, list(events)))
        self._wake()

    def close(self) -> None:
        if self._thread.is_alive():
            self._out.put(None)
            self._wake()
            self._thread.join(5.0)
        self._wake_tx.close(linger=0)
        self._guard.close()
        self._ctx.term()

    def refused(self) -> dict[str, int]:
        """Connections turned away so far, by reason (``links/guard.py``)."""
        return self._guard.refused()

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        try:
            pub = self._ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            self.security.server(pub)
            pub.bind(bindable(self._requested[0]))
            self._guard.watch(pub)
            replay = None
            if self._requested[1]:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, self._hwm)
                self.security.server(replay)
                replay.bind(bindable(self._requested[1]))
                self._guard.watch(replay)
            self.endpoints = (
                pub.getsockopt_string(zmq.LAST_ENDPOINT),
                replay.getsockopt_string(zmq.LAST_ENDPOINT) if replay else None,
            )
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        for sock in (pub, replay, self._wake_rx):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if pub in ready:
                    self._subscriptions(pub)
                if replay is not None and replay in ready:
                    self._request(replay)
                if self._wake_rx in ready:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                if not self._drain(pub, replay):
                    return
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            self._wake_rx.close(linger=0)

    def _subscriptions(self, pub: zmq.Socket) -> None:
        while pub.poll(0):
            msg = pub.recv()
            if msg[:1] == b"\x01":
                self._topics.add(msg[1:])
            elif msg[:1] == b"\x00":
                self._topics.discard(msg[1:])
        self.subscribed = any(self._topic.startswith(t) for t in self._topics)

    def _request(self, replay: zmq.Socket) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
                continue
            client, _, body = frames
            if body == DUMP_REQUEST:
                self._dumps.append(client)
                continue
            try:
                start = seq_from_bytes(body)
            except ValueError:
                log.warning("ignoring a KV event replay request for %r", body[:16])
                continue
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart([client, b"", seq_bytes(seq), payload])
            replay.send_multipart([client, b"", END_SEQ, b""])

    def _drain(self, pub: zmq.Socket, replay: zmq.Socket | None) -> bool:
        while True:
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            kind, a, events = item
            if kind == "batch":
                seq = next(self._seq)
                payload = encode_batch(EventBatch(a, events, self._rank))
                pub.send_multipart([self._topic, seq_bytes(seq), payload], zmq.NOBLOCK)
                self._buffer.append((seq, payload))
                self._last_seq = seq
                self.published_batches += 1
            elif replay is not None:  # a dump for client ``a``, as of the last batch sent
                stamp = seq_bytes(self._last_seq)
                for i in range(0, max(len(events), 1), DUMP_EVENTS_PER_MESSAGE):
                    chunk = events[i : i + DUMP_EVENTS_PER_MESSAGE]
                    payload = encode_batch(EventBatch(time.time(), chunk, self._rank))
                    replay.send_multipart([a, b"", stamp, payload])
                replay.send_multipart([a, b"", END_SEQ, b""])
