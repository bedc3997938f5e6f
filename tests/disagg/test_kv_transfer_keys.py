"""The KV transfer socket behind CurveZMQ.

- A decode instance without an allowed key (another key pair, none at all, or expecting
  another server key) cannot ask a prefill instance for KV: its transfers fail, the prefill
  side never sees a request, and its socket goes on serving decode instances with the key.
- A prefill peer that does not hold the server key a decode instance expects cannot put a
  byte into its pool, even one that would gladly send.
- Bytes that are not ZeroMQ and a handshake cut short are turned away too; every refusal is
  counted by reason and logged once per peer.
"""

from __future__ import annotations

import logging
import socket
import time

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.disagg import TransferState
from radixserve.disagg.zmq_receiver import ZmqKVReceiver
from radixserve.disagg.zmq_sender import ZmqKVSender
from radixserve.links.keys import PLAIN, CurveKeys, join_endpoint, load_security, split_endpoint
from testing.transfer_peer import HEARTBEAT, layout_of, seeded_pool, untouched

SEED = 99
ZMTP_GREETING_START = b"\xff" + b"\x00" * 8 + b"\x7f"


def receiver(security) -> tuple[KVPool, ZmqKVReceiver]:
    pool = seeded_pool(64, "float32", None)
    return pool, ZmqKVReceiver(pool, layout_of(pool), security=security, **HEARTBEAT)


def serve_once(sender: ZmqKVSender) -> int:
    """Push whatever was asked for; how many requests there were."""
    reqs = sender.incoming()
    for req in reqs:
        sender.push(req.transfer_id, torch.tensor(req.meta["src"]))
    sender.finished()
    return len(reqs)


def fetch(rx: ZmqKVReceiver, endpoint: str, sender: ZmqKVSender | None = None):
    """One transfer of 6 tokens into slots 10..15, served by ``sender`` while it runs."""
    tid = rx.request(endpoint, torch.arange(10, 16), {"src": list(range(6))}, b"", 5.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sender is not None:
            serve_once(sender)
        for key, status in rx.progress():
            if key == tid:
                return status
        time.sleep(0.01)
    raise AssertionError("the transfer did not end")


def test_a_decode_without_the_key_cannot_fetch_kv(caplog):
    caplog.set_level(logging.WARNING, logger="radixserve.links")
    fleet = load_security()
    source = seeded_pool(64, "float32", SEED)
    sender = ZmqKVSender(source, layout_of(source), security=fleet, **HEARTBEAT)
    port = int(split_endpoint(sender.endpoint)[0].rsplit(":", 1)[1])
    stranger, others = CurveKeys.generate(), CurveKeys.generate()
    raw = []
    try:
        attempts = [
            (stranger, sender.endpoint),  # a key the prefill instance does not allow
            (stranger, sender.endpoint),  # again, from the same address: logged once
            (PLAIN, sender.endpoint),  # no CurveZMQ
            (fleet, join_endpoint(split_endpoint(sender.endpoint)[0], others.public_key)),
        ]
        for security, endpoint in attempts:
            pool, rx = receiver(security)
            try:
                status = fetch(rx, endpoint, sender)
                assert status.state is TransferState.FAILED
                assert "no handshake answer" in status.reason and status.tokens == 0
                assert untouched(pool)
            finally:
                rx.close()
        garbage = socket.create_connection(("127.0.0.1", port))
        garbage.sendall(b"\x00" * 64 + bytes(range(256)) * 16)
        cut = socket.create_connection(("127.0.0.1", port))
        cut.sendall(ZMTP_GREETING_START)
        cut.close()
        raw.append(garbage)
        time.sleep(0.3)
        assert serve_once(sender) == 0  # not one request got through
        refused = sender.refused()
        assert refused.get("key", 0) >= 2 and refused.get("protocol", 0) >= 3, refused
        assert refused.get("handshake", 0) >= 1, refused
        assert sender.stats.transfers_done == 0 and sender.stats.tokens == 0

        pool, rx = receiver(fleet)  # the socket still serves a decode instance with the key
        try:
            status = fetch(rx, sender.endpoint, sender)
            assert status.state is TransferState.DONE, status.reason
            assert torch.equal(pool.k[:, :, 10:16], source.k[:, :, :6])
            assert untouched(pool, torch.arange(10, 16))
        finally:
            rx.close()
    finally:
        for r in raw:
            r.close()
        sender.close()
    refusals = [r for r in caplog.records if "refused a client at 127.0.0.1" in r.message]
    assert len(refusals) == 1, [r.message for r in refusals]


def test_a_prefill_without_the_key_cannot_push_kv():
    """Rogue prefill peers at addresses the decode instance was told of, without their key:
    it expects the fleet's server key there. One holds a key pair of its own, one speaks
    plain ZeroMQ; both would send everything asked for."""
    fleet = load_security()
    for rogue_security in (CurveKeys.generate(), PLAIN):
        source = seeded_pool(64, "float32", SEED)
        rogue = ZmqKVSender(source, layout_of(source), security=rogue_security, **HEARTBEAT)
        address = split_endpoint(rogue.endpoint)[0]
        pool, rx = receiver(fleet)
        try:
            status = fetch(rx, address, rogue)
            assert status.state is TransferState.FAILED and status.tokens == 0
            assert rogue.stats.tokens == 0  # it never got a request to answer
            assert untouched(pool)
            assert rx.stats.bytes == 0
        finally:
            rx.close()
            rogue.close()


def test_per_instance_keys_the_endpoint_carries():
    """The prefill instance has its own key pair and allows the decode instance's key; its
    endpoint carries its public key, which is all the decode instance needs to know."""
    prefill_keys, decode_keys = CurveKeys.generate(), CurveKeys.generate()
    security = CurveKeys(prefill_keys.public_key, prefill_keys.secret_key,
                         frozenset({decode_keys.public_key}))  # fmt: skip
    source = seeded_pool(64, "float32", SEED)
    sender = ZmqKVSender(source, layout_of(source), security=security, **HEARTBEAT)
    assert split_endpoint(sender.endpoint)[1] == prefill_keys.public_key
    pool, rx = receiver(decode_keys)
    try:
        status = fetch(rx, sender.endpoint, sender)
        assert status.state is TransferState.DONE, status.reason
        assert torch.equal(pool.v[:, :, 10:16], source.v[:, :, :6])
        assert sender.refused() == {}
    finally:
        rx.close()
        sender.close()


def test_a_peer_endpoint_with_a_bad_key_fails_that_transfer_only():
    pool, rx = receiver(load_security())
    try:
        status = fetch(rx, "tcp://127.0.0.1:9?curve=not-a-key")
        assert status.state is TransferState.FAILED and "not a CurveZMQ key" in status.reason
        assert untouched(pool)
    finally:
        rx.close()


def test_plain_sockets_when_both_sides_ask_for_them():
    source = seeded_pool(64, "float32", SEED)
    sender = ZmqKVSender(source, layout_of(source), security=PLAIN, **HEARTBEAT)
    assert "?curve=" not in sender.endpoint
    pool, rx = receiver(PLAIN)
    try:
        assert fetch(rx, sender.endpoint, sender).state is TransferState.DONE
        assert torch.equal(pool.k[:, :, 10:16], source.k[:, :, :6])
    finally:
        rx.close()
        sender.close()
