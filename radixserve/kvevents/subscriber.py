"""A KV-event subscriber (asyncio): one publisher's stream, applied exactly once and in order.

It connects a SUB socket (and, per request, a DEALER to the replay endpoint), asks for a dump
of the publisher's tree, then applies live batches after the dump's sequence number. A gap in
sequence numbers (the publisher dropped messages for us past its high-water mark) is filled
by a replay request; if the replay buffer no longer holds the missing batches, the subscriber
calls ``on_reset`` and resyncs from a fresh dump.

A batch that begins with ``AllBlocksCleared`` is a full snapshot (a publisher sends one when
events switch on: its first subscriber, or a restarted engine), so it resets the stream
wherever its sequence number falls: ``on_reset``, apply, continue after it. Without a replay
endpoint the subscriber trusts the stream from the first batch it sees. ``on_events``
receives each batch's events in sequence order.

Both sockets take the process's ``security`` and the publisher's public key (``server_key``;
``links/keys.py``): with CurveZMQ a publisher that does not hold that key, or does not allow
ours, sends nothing (replay requests time out).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from radixserve.kvevents.types import AllBlocksCleared, EventBatch, KVEvent
from radixserve.kvevents.wire import (
    DUMP_REQUEST,
    WireError,
    decode_batch,
    seq_bytes,
    seq_from_bytes,
)
from radixserve.links.keys import ZmqSecurity

log = logging.getLogger("radixserve")


class ReplayError(RuntimeError):
    pass


class EventSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        on_events: Callable[[list[KVEvent]], None],
        on_reset: Callable[[], None],
        *,
        security: ZmqSecurity,
        server_key: bytes | None = None,
        topic: bytes = b"",
        replay_timeout: float = 5.0,
        ctx: zmq.asyncio.Context | None = None,
    ):
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.on_events, self.on_reset = on_events, on_reset
        self.topic = topic
        self.security, self.server_key = security, server_key
        self.replay_timeout = replay_timeout
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.next_seq: int | None = None  # the sequence number expected next
        self.applied_batches = 0
        self.replays = 0
        self.dumps = 0
        self.synced = asyncio.Event()

    async def run(self) -> None:
        """Follow the stream until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        self.security.client(sub, self.server_key)
        sub.connect(self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            if self.replay_endpoint:
                await self._resync(reset=False)
            self.synced.set()
            while True:
                _, seq_raw, payload = await sub.recv_multipart()
                try:
                    batch = decode_batch(payload)
                except WireError as e:
                    log.warning("unreadable KV event batch from %s: %s", self.endpoint, e)
                    continue
                await self._receive(seq_from_bytes(seq_raw), batch)
        finally:
            sub.close(linger=0)

    async def _receive(self, seq: int, batch: EventBatch) -> None:
        if batch.events and isinstance(batch.events[0], AllBlocksCleared):
            self.on_reset()
            self._apply(seq, batch)
            return
        expected = self.next_seq
        if expected is None or not self.replay_endpoint:
            self._apply(seq, batch)
            return
        if seq < expected:
            return  # a duplicate: the dump or a replay had it
        if seq > expected and not await self._replay(expected, seq):
            await self._resync(reset=True)
            if seq < (self.next_seq or 0):
                return
            if seq > (self.next_seq or 0) and not await self._replay(self.next_seq, seq):
                log.warning(
                    "KV events %d..%d from %s are lost", self.next_seq, seq - 1, self.endpoint
                )
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: EventBatch) -> None:
        self.on_events(batch.events)
        self.next_seq = seq + 1
        self.applied_batches += 1

    async def _ask(self, body: bytes) -> list[tuple[int, EventBatch]]:
        """One replay-socket request; the (seq, batch) messages answered before the end."""
        dealer = self._ctx.socket(zmq.DEALER)
        self.security.client(dealer, self.server_key)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", body])
            out = []
            while True:
                if not await dealer.poll(self.replay_timeout * 1000):
                    raise ReplayError(
                        f"{self.replay_endpoint} did not answer in time (is the publisher up, "
                        "and do its ZeroMQ keys and ours match?)"
                    )
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    raise ReplayError(f"malformed replay answer ({len(frames)} frames)")
                if frames[2] == b"":
                    return out
                out.append((seq_from_bytes(frames[1]), decode_batch(frames[2])))
        finally:
            dealer.close(linger=0)

    async def _replay(self, start: int, upto: int) -> bool:
        """Apply batches ``start .. upto - 1``; False if the publisher no longer has them."""
        self.replays += 1
        got = [m for m in await self._ask(seq_bytes(start)) if m[0] < upto]
        if [s for s, _ in got] != list(range(start, upto)):
            return False
        for seq, batch in got:
            self._apply(seq, batch)
        return True

    async def _resync(self, reset: bool) -> None:
        """Replace everything known about the publisher with a dump of its tree."""
        self.dumps += 1
        messages = await self._ask(DUMP_REQUEST)
        if reset:
            self.on_reset()
        for _, batch in messages:
            self.on_events(batch.events)
        # a dump always has a message: its stamp is the last batch it includes
        self.next_seq = messages[-1][0] + 1 if messages else None
