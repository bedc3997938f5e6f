"""KV events behind CurveZMQ: only subscribers holding an allowed key get any event; the
others, and bytes that are not ZeroMQ at all, are turned away, counted and logged once, and
the publisher goes on serving its subscribers."""

import asyncio
import dataclasses
import logging
import socket

import numpy as np
import zmq

from radixserve.kvevents.subscriber import EventSubscriber
from radixserve.links.keys import PLAIN, CurveKeys
from testing.kv_events import KEYS, Harness, Index, expected_blocks, prompts

ZMTP_GREETING_START = b"\xff" + b"\x00" * 8 + b"\x7f"  # the first 10 bytes of a ZMTP greeting


def stranger(endpoint: str, security, server_key=None) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.linger = 0
    security.client(sub, server_key)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


def tcp_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


async def _strangers_get_nothing(engine, caplog):
    h = Harness(engine)
    others = CurveKeys.generate()
    subs = [
        stranger(h.endpoint, others, KEYS.public_key),  # a key the publisher does not allow
        stranger(h.endpoint, others, KEYS.public_key),  # the same, again: logged once
        stranger(h.endpoint, KEYS, others.public_key),  # expects another server
        stranger(h.endpoint, PLAIN),  # no CurveZMQ at all
    ]
    raw = []
    for endpoint in (h.endpoint, h.replay):
        garbage = socket.create_connection(("127.0.0.1", tcp_port(endpoint)))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
        cut = socket.create_connection(("127.0.0.1", tcp_port(endpoint)))
        cut.sendall(ZMTP_GREETING_START)
        cut.close()  # a handshake cut short
        raw.append(garbage)
    try:
        rng = np.random.default_rng(3)
        system = rng.integers(5, 4000, 40).tolist()
        for _ in range(10):
            await h.run(prompts(rng, 2, system))
            h.bridge.sync()
            await asyncio.sleep(0.05)
        assert engine.cache.total_size() > 0
        # nobody the publisher admits listens: events never even switched on
        assert not h.pub.subscribed and engine.kv_events is None
        assert h.pub.published_batches == 0
        assert all(s.poll(0) == 0 for s in subs)
        refused = h.pub.refused()
        assert refused.get("key", 0) >= 2 and refused.get("protocol", 0) >= 3, refused

        # the publisher still serves a subscriber with the key
        seen = Index()
        sub = EventSubscriber(h.endpoint, h.replay, seen.apply, seen.reset, security=KEYS)
        task = asyncio.create_task(sub.run())
        await h.run(prompts(rng, 2, system))
        await h.settle(sub)
        assert set(seen.blocks) == expected_blocks(engine.cache) != set()
        assert all(s.poll(0) == 0 for s in subs)  # and still nothing for the others
        task.cancel()
    finally:
        for s in subs:
            s.close(0)
        for r in raw:
            r.close()
        h.pub.close()
    refusals = [r for r in caplog.records if "refused a client at 127.0.0.1" in r.message]
    assert len(refusals) == 1, [r.message for r in refusals]  # once per peer


def test_a_subscriber_without_the_key_receives_no_event(make_engine, caplog):
    caplog.set_level(logging.WARNING, logger="radixserve.links")
    asyncio.run(_strangers_get_nothing(make_engine(max_total_tokens=600), caplog))


async def _own_keys(engine, server: CurveKeys, client: CurveKeys, security):
    h = Harness(engine, security=security)
    seen = Index()
    sub = EventSubscriber(
        h.endpoint, h.replay, seen.apply, seen.reset, security=client,
        server_key=server.public_key,
    )  # fmt: skip
    task = asyncio.create_task(sub.run())
    try:
        rng = np.random.default_rng(4)
        await h.run(prompts(rng, 3, rng.integers(5, 4000, 40).tolist()))
        await h.settle(sub)
        assert set(seen.blocks) == expected_blocks(engine.cache) != set()
        assert h.pub.refused() == {}
    finally:
        task.cancel()
        h.pub.close()


def test_per_instance_keys_with_an_allow_list(make_engine):
    """The publisher has its own key pair and allows the router's key; the router knows the
    publisher's public key."""
    server, client = CurveKeys.generate(), CurveKeys.generate()
    security = dataclasses.replace(server, allowed=frozenset({client.public_key}))
    asyncio.run(_own_keys(make_engine(max_total_tokens=600), server, client, security))


def test_plain_sockets_when_asked_for(make_engine):
    asyncio.run(_own_keys(make_engine(max_total_tokens=600), KEYS, PLAIN, PLAIN))
