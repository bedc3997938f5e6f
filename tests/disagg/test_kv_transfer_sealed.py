"""The KV of a transfer with keys, sealed on its own connection (``disagg/zmq_sealed.py``).

A man in the middle of that plain connection (``testing/data_proxy.py``) tampers with a KV
message, replays one, reorders two, or forges one under a key of its own: the decode side
refuses it before a byte of it reaches the pool, drops the connection (the transfer fails,
counted as ``sealed``), and the next transfer over a fresh connection lands whole. A client
without the key on the prefill side's data port (garbage, a BIND under another key, the
decode side's own BIND replayed) gets nothing and takes no transfer's route from it.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time

import pytest
import torch
import zmq

from radixserve import SamplingParams
from radixserve.disagg import TransferState
from radixserve.disagg.zmq_receiver import ZmqKVReceiver
from radixserve.disagg.zmq_sender import ZmqKVSender
from radixserve.links.keys import load_security
from radixserve.links.sealed import Sealer
from testing.data_proxy import DataProxy, relay
from testing.transfer_peer import HEARTBEAT, garbage_pool, layout_of, seeded_pool, untouched

SEED = 41
DST = torch.arange(10, 16)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
MESSAGE_BYTES = 200  # 3 tokens of one layer a message: a 6-token transfer is 6 messages


@pytest.fixture
def link():
    """(source pool, sender, proxy, decode pool, receiver): the decode side's data
    connection goes through the proxy."""
    fleet = load_security()
    source = seeded_pool(64, "float32", SEED)
    proxy = DataProxy()
    sender = ZmqKVSender(source, layout_of(source), security=fleet, message_bytes=MESSAGE_BYTES,
                         advertise_data_port=proxy.port, **HEARTBEAT)  # fmt: skip
    proxy.connect(sender.data_port)
    pool = seeded_pool(64, "float32", None)
    rx = ZmqKVReceiver(pool, layout_of(pool), security=fleet, **HEARTBEAT)
    yield source, sender, proxy, pool, rx
    rx.close()
    sender.close()
    proxy.close()


def fetch(rx: ZmqKVReceiver, sender: ZmqKVSender):
    """Tokens 0..5 of the source into slots 10..15, served while the transfer runs."""
    tid = rx.request(sender.endpoint, DST, {}, b"", 5.0)
    for _ in range(1000):
        for req in sender.incoming():
            sender.push(req.transfer_id, torch.arange(req.num_tokens))
        sender.finished()
        for key, status in rx.progress():
            if key == tid:
                return status
        select.select([rx.fileno(), sender.fileno()], [], [], 0.01)
    raise AssertionError("the transfer did not end")


def landed_whole(pool, source) -> bool:
    return all(torch.equal(a[:, :, DST], b[:, :, :6]) for a, b in ((pool.k, source.k),
                                                                  (pool.v, source.v)))  # fmt: skip


def meddler(how: str):
    """A ``meddle`` for the proxy that spoils the transfer's first KV messages ``how``."""
    seen: list[list[bytes]] = []

    def meddle(frames: list[bytes]) -> list[list[bytes]]:
        seen.append(frames)
        n = len(seen)
        if how == "tamper" and n == 1:  # one bit of K's ciphertext
            k = bytearray(frames[3])
            k[len(k) // 2] ^= 1
            return [[*frames[:3], bytes(k), frames[4]]]
        if how == "header" and n == 1:  # the same payload for other tokens
            h = bytearray(frames[1])
            struct.pack_into("!I", h, 16, 1)
            return [[frames[0], bytes(h), *frames[2:]]]
        if how == "replay" and n == 2:
            return [seen[0], frames]
        if how == "reorder":
            return [] if n == 1 else [frames, seen[0]] if n == 2 else [frames]
        if how == "forge" and n == 1:  # well formed, sealed under a key of its own
            forged = Sealer(os.urandom(32)).seal(frames[0], frames[1], [b"\0" * 192] * 2)
            return [[frames[0], frames[1], *forged], frames]
        return [frames]

    return meddle


@pytest.mark.parametrize("how", ["tamper", "header", "replay", "reorder", "forge"])
def test_a_spoiled_kv_message_is_refused_and_the_next_transfer_lands(link, how):
    source, sender, proxy, pool, rx = link
    proxy.meddle = meddler(how)
    status = fetch(rx, sender)
    assert status.state is TransferState.FAILED, status
    assert "failed its authentication" in status.reason and status.kind == "sealed", status
    assert rx.refused() == {"sealed": 1}
    if how in ("tamper", "header", "forge"):  # the spoiled message was the first
        assert untouched(pool) and rx.stats.bytes == 0
    else:  # what landed before it is the source's own, in the transfer's slots only
        assert untouched(pool, DST) and 0 < rx.stats.bytes
        k, src = pool.k[:, :, DST], source.k[:, :, :6]
        assert torch.equal(k[k != 0], src[k != 0])

    proxy.meddle = relay  # the instance goes on: a new connection, a new session
    pool.k.zero_()
    pool.v.zero_()
    status = fetch(rx, sender)
    assert status.state is TransferState.DONE, status.reason
    assert landed_whole(pool, source) and untouched(pool, DST)
    assert rx.refused() == {"sealed": 1}


def test_a_client_without_the_key_gets_nothing_from_the_data_port(link):
    source, sender, proxy, pool, rx = link
    assert fetch(rx, sender).state is TransferState.DONE
    (bind,) = proxy.upstream  # the decode side's BIND: BIND, session, sequence, sealed
    ctx = zmq.Context()
    strangers = []
    try:
        for frames in (
            [b"garbage"],
            [b"BIND", os.urandom(16), *Sealer(os.urandom(32)).seal(b"BIND", b"x" * 16, [b""])],
            [b"BIND", bind[1], *Sealer(os.urandom(32)).seal(b"BIND", bind[1], [b""])],
            bind,  # replayed from another connection: would take the session's route
        ):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(f"tcp://127.0.0.1:{sender.data_port}")
            s.send_multipart(frames)
            strangers.append(s)
        for _ in range(200):
            if sender.refused().get("sealed", 0) >= 4:
                break
            time.sleep(0.01)
        assert sender.refused() == {"sealed": 4}

        pool.k.zero_()
        pool.v.zero_()
        status = fetch(rx, sender)  # the same connection and session as before
        assert status.state is TransferState.DONE, status.reason
        assert landed_whole(pool, source)
        assert not any(s.poll(100) for s in strangers)  # not one KV message went astray
    finally:
        ctx.destroy(linger=0)


def test_a_fixed_data_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fleet = load_security()
    source = seeded_pool(64, "float32", SEED)
    sender = ZmqKVSender(source, layout_of(source), security=fleet, data_port=port, **HEARTBEAT)
    pool = seeded_pool(64, "float32", None)
    rx = ZmqKVReceiver(pool, layout_of(pool), security=fleet, **HEARTBEAT)
    try:
        assert sender.data_port == port
        assert fetch(rx, sender).state is TransferState.DONE and landed_whole(pool, source)
    finally:
        rx.close()
        sender.close()


def test_an_unreachable_data_port_fails_transfers_with_a_reason():
    """The decode instance is told a data port nothing listens on (a firewall, a wrong port
    forward): the prefill side gives up on it after a heartbeat timeout and says why."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    fleet = load_security()
    source = seeded_pool(64, "float32", SEED)
    sender = ZmqKVSender(source, layout_of(source), security=fleet, advertise_data_port=closed,
                         **HEARTBEAT)  # fmt: skip
    pool = seeded_pool(64, "float32", None)
    rx = ZmqKVReceiver(pool, layout_of(pool), security=fleet, **HEARTBEAT)
    try:
        status = fetch(rx, sender)
        assert status.state is TransferState.FAILED
        assert f"no sealed KV connection reached data port {sender.data_port}" in status.reason
        assert untouched(pool)
        assert sender.stats.failures == {"peer_lost": 1}  # its request ended there too
    finally:
        rx.close()
        sender.close()


def test_plain_sockets_have_no_data_port():
    from radixserve.links.keys import PLAIN

    source = seeded_pool(8, "float32", SEED)
    sender = ZmqKVSender(source, layout_of(source), security=PLAIN, **HEARTBEAT)
    try:
        assert sender.data_port is None
    finally:
        sender.close()


def test_without_a_sealed_connection_the_kv_goes_over_curvezmq(link):
    source, sender, proxy, pool, _ = link
    rx = ZmqKVReceiver(pool, layout_of(pool), security=load_security(), sealed_data=False,
                       **HEARTBEAT)  # fmt: skip
    try:
        assert fetch(rx, sender).state is TransferState.DONE
        assert landed_whole(pool, source) and proxy.upstream == []
    finally:
        rx.close()


def test_a_tampered_transfer_leaves_a_decode_engine_its_own_tree(make_engine):
    """A decode engine whose KV would be garbage if the spoiled message landed: the prompt
    is computed here, the answer is the colocated one, and what the tree holds is its own
    (a repeat of the prompt hits the cache and answers the same)."""
    decode = make_engine(disaggregation_mode="decode", remote_prefill_min_tokens=1,
                         kv_transfer_heartbeat=0.1)  # fmt: skip
    colocated = make_engine()
    layout = decode.info().disaggregation.layout
    proxy = DataProxy()
    sender = ZmqKVSender(garbage_pool(layout, 256), layout, security=load_security(),
                         advertise_data_port=proxy.port, **HEARTBEAT)  # fmt: skip
    proxy.connect(sender.data_port).meddle = meddler("tamper")
    prompt = torch.randint(100, 4000, (40,), generator=torch.Generator().manual_seed(SEED))
    try:
        want = generate(colocated, prompt.tolist())
        assert generate(decode, prompt.tolist(), sender) == want
        assert decode.stats().kv_transfer.failures == {"sealed": 1}
        assert decode.cache.peek_prefix(prompt.tolist()).length >= len(prompt) - 1
        assert generate(decode, prompt.tolist()) == want  # from the tree, computed here
    finally:
        sender.close()
        proxy.close()


def generate(engine, prompt: list[int], sender: ZmqKVSender | None = None) -> list[int]:
    """The greedy answer, the prompt's KV taken from ``sender`` (served meanwhile) if given."""
    rid = f"r{time.monotonic_ns()}"
    peer = {"prefill_peer": sender.endpoint} if sender is not None else {}
    engine.add_request(rid, prompt, GREEDY, **peer)
    out: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sender is not None:
            for req in sender.incoming():
                sender.push(req.transfer_id, torch.arange(req.num_tokens))
            sender.finished()
        for o in engine.step():
            out += o.new_token_ids
            if o.finished:
                return out
        time.sleep(0.001)
    raise AssertionError("the request did not finish")
