"""KV transfer over ZeroMQ between two real KV pools in two processes.

A spawned prefill peer (``transfer_peer.py``) serves pages from a pool filled from a seed;
the test process is the decode side and checks, byte for byte, that exactly the requested
slots received exactly the peer's slots, and that every failure ends the transfer on both
sides with a reason, without a byte landing afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
import zmq

from radixserve.disagg import LayoutMismatchError, TransferError, TransferState, wire
from radixserve.disagg.zmq_receiver import ZmqKVReceiver
from radixserve.disagg.zmq_sender import ZmqKVSender
from radixserve.links.keys import load_security
from testing.transfer_peer import (
    HEARTBEAT,
    layout_of,
    poll_until,
    run_prefill_peer,
    seeded_pool,
    untouched,
    wait_end,
)

SEED = 1234
CTX = mp.get_context("spawn")


class Peer:
    """The prefill peer process; ``endpoints`` maps a layout name to its sender's address."""

    def __init__(self):
        self.reports = CTX.Queue()
        self.proc = CTX.Process(target=run_prefill_peer, args=(self.reports, SEED), daemon=True)
        self.proc.start()
        self.endpoints = self.reports.get(timeout=120)

    def report_about(self, tid: str, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while True:
            r = self.reports.get(timeout=max(0.01, deadline - time.monotonic()))
            if r[0] == tid:
                return r

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join(10)


@pytest.fixture(scope="module")
def peers():
    running: list[Peer] = []
    yield running
    for p in running:
        p.stop()


@pytest.fixture
def peer(peers) -> Peer:
    """The shared prefill peer, started again if a test killed it."""
    if not peers or not peers[-1].proc.is_alive():
        peers.append(Peer())
    return peers[-1]


@pytest.fixture
def receiver_for():
    made = []

    def make(dtype: str = "float32", page_size: int = 1):
        pool = seeded_pool(128, dtype, None)
        receiver = ZmqKVReceiver(
            pool, layout_of(pool, page_size), security=load_security(), **HEARTBEAT
        )
        made.append(receiver)
        return pool, receiver

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("pieces", [1, 3])
def test_kv_lands_in_the_requested_slots_and_nowhere_else(peer, receiver_for, pieces):
    endpoint = peer.endpoints["f32"]
    pool, receiver = receiver_for()
    src = torch.tensor([3, 17, 18, 19, 100, 5, 6, 250, 251, 7, 8])
    dst = torch.tensor([40, 41, 42, 43, 2, 90, 91, 92, 10, 11, 127])
    tid = receiver.request(endpoint, dst, {"src": src.tolist(), "pieces": pieces})
    status = wait_end(receiver, tid)
    assert status.state is TransferState.DONE, status.reason
    source = seeded_pool(256, "float32", SEED)
    assert torch.equal(pool.k[:, :, dst], source.k[:, :, src])
    assert torch.equal(pool.v[:, :, dst], source.v[:, :, src])
    assert untouched(pool, dst)
    assert status.tokens == len(dst)
    assert status.bytes == len(dst) * receiver.layout.bytes_per_token() == 11 * 2 * 3 * 2 * 8 * 4
    assert peer.report_about(tid)[1:] == ("done", None)  # the sender heard the decode side


def test_bfloat16_pages_move_bit_exact(peer, receiver_for):
    endpoint = peer.endpoints["bf16"]
    pool, receiver = receiver_for("bfloat16", page_size=4)
    src, dst = torch.arange(8, 20), torch.arange(64, 76)  # three whole pages
    tid = receiver.request(endpoint, dst, {"src": src.tolist()})
    assert wait_end(receiver, tid).state is TransferState.DONE
    source = seeded_pool(256, "bfloat16", SEED)
    assert torch.equal(pool.k[:, :, dst], source.k[:, :, src])
    assert torch.equal(pool.v[:, :, dst], source.v[:, :, src])
    assert untouched(pool, dst)


def test_int8_rows_move_bit_exact_in_pieces(peer, receiver_for):
    """int8 rows (codes, then their float16 scales) cross as bytes: every byte lands, in
    messages smaller than a token's rows of every layer."""
    pool, receiver = receiver_for("int8", page_size=4)
    assert receiver.layout.kv_format == "int8g16" and pool.k.dtype == torch.uint8
    src, dst = torch.arange(8, 20), torch.arange(64, 76)
    tid = receiver.request(peer.endpoints["i8"], dst, {"src": src.tolist(), "pieces": 2})
    status = wait_end(receiver, tid)
    assert status.state is TransferState.DONE, status.reason
    source = seeded_pool(256, "int8", SEED)
    assert torch.equal(pool.k[:, :, dst], source.k[:, :, src])
    assert torch.equal(pool.v[:, :, dst], source.v[:, :, src])
    assert untouched(pool, dst)
    assert status.bytes == 12 * 2 * 3 * 2 * (16 + 2)  # K and V, layers, heads, row bytes


def test_a_layout_mismatch_is_a_clear_error_and_moves_nothing(peer, receiver_for):
    endpoint = peer.endpoints["bf16"]
    pool, receiver = receiver_for("float32", page_size=1)
    with pytest.raises(LayoutMismatchError) as err:
        receiver.check_peer(endpoint)
    assert "kv_format: 'float32' here, 'bfloat16' there" in str(err.value)
    assert "page_size: 1 here, 4 there" in str(err.value)
    tid = receiver.request(endpoint, torch.arange(4), {"src": [0, 1, 2, 3]})
    status = wait_end(receiver, tid)
    assert status.state is TransferState.FAILED and "KV layouts differ" in status.reason
    assert untouched(pool)


def test_a_transfer_that_never_comes_times_out_and_the_sender_is_told(peer, receiver_for):
    endpoint = peer.endpoints["f32"]
    pool, receiver = receiver_for()
    t0 = time.monotonic()
    tid = receiver.request(endpoint, torch.arange(5), {"src": [0] * 5, "mode": "silent"}, b"", 0.5)
    status = wait_end(receiver, tid)
    assert status.state is TransferState.FAILED and "timed out after 0.5 s" in status.reason
    assert 0.5 <= time.monotonic() - t0 < 3
    _, state, reason = peer.report_about(tid)
    assert state == "failed" and "cancelled" in reason and "timed out" in reason
    assert receiver.stats.failures == {"timeout": 1}
    assert untouched(pool)


def test_nothing_lands_after_a_cancel(peer, receiver_for):
    endpoint = peer.endpoints["f32"]
    pool, receiver = receiver_for()
    meta = {"src": [1, 2, 3], "mode": "late", "delay": 0.4}
    tid = receiver.request(endpoint, torch.tensor([5, 6, 7]), meta)
    time.sleep(0.1)
    receiver.cancel(tid, "the client went away")
    assert peer.report_about(tid)[1] == "failed"  # the sender learnt of it ...
    assert peer.report_about(tid)[1] == "push_refused"  # ... and refused its late push
    time.sleep(0.2)
    assert receiver.progress() == [] and receiver.status(tid) is None
    assert untouched(pool)


def test_an_abort_on_the_prefill_side_reaches_the_decode_side(peer, receiver_for):
    endpoint = peer.endpoints["f32"]
    _, receiver = receiver_for()
    tid = receiver.request(endpoint, torch.arange(3), {"src": [0, 1, 2], "mode": "abort"})
    status = wait_end(receiver, tid)
    assert status.state is TransferState.FAILED
    assert status.reason == "prefill side: prompt rejected by the test"


class FakePrefill:
    """A ROUTER socket the test drives by hand, standing in for a prefill instance."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        load_security().server(self.sock)  # it holds the fleet key: the test plays a peer
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def recv(self, timeout_ms: int = 5000) -> list[bytes]:
        assert self.sock.poll(timeout_ms), "nothing arrived"
        return self.sock.recv_multipart()

    def welcome(self, peer_id: bytes, layout) -> None:
        body = wire.pack_json({"layout": layout.to_dict()})
        self.sock.send_multipart([peer_id, wire.WELCOME, body])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_a_request_cancelled_before_the_handshake_is_never_sent(receiver_for):
    _, receiver = receiver_for()
    fake = FakePrefill()
    try:
        tid = receiver.request(fake.endpoint, torch.tensor([1, 2]), {})
        peer_id, kind, _ = fake.recv()
        assert kind == wire.HELLO
        receiver.cancel(tid)
        time.sleep(0.05)  # let the I/O thread take the cancel before the WELCOME
        fake.welcome(peer_id, receiver.layout)
        kinds = set()
        while fake.sock.poll(3 * int(1000 * HEARTBEAT["heartbeat_interval"])):
            kinds.add(fake.recv()[1])
            if len(kinds) > 1 or wire.PING in kinds:
                break
        assert kinds == {wire.PING}  # heartbeats only: no REQ, no CANCEL
    finally:
        fake.close()


def test_malformed_kv_data_fails_the_transfer_and_writes_nothing(receiver_for):
    """A fake prefill peer passes the handshake, then sends a frame of the wrong size."""
    pool, receiver = receiver_for()
    fake = FakePrefill()
    try:
        tid = receiver.request(fake.endpoint, torch.tensor([1, 2]), {})
        peer_id, kind, _ = fake.recv()
        assert kind == wire.HELLO
        fake.welcome(peer_id, receiver.layout)
        _, kind, raw_tid, _, _ = fake.recv()
        assert kind == wire.REQ
        header = wire.DataHeader(raw_tid, 0, 2, 0, 3).pack()
        fake.sock.send_multipart([peer_id, wire.DATA, header, b"x" * 10, b"x" * 10])
        status = wait_end(receiver, tid)
        assert status.state is TransferState.FAILED and "bad KV data" in status.reason
        assert "frame of 10 bytes" in status.reason
        frames = fake.recv()
        while frames[1] == wire.PING:
            frames = fake.recv()
        assert frames[1] == wire.FAIL and b"bad KV data" in frames[3]  # told to stop
        assert untouched(pool)
    finally:
        fake.close()


def test_a_decode_that_goes_silent_fails_the_senders_transfer(receiver_for):
    pool = seeded_pool(64, "float32", SEED)
    sender = ZmqKVSender(pool, layout_of(pool), security=load_security(), **HEARTBEAT)
    try:
        _, receiver = receiver_for()
        receiver.request(sender.endpoint, torch.arange(6), {"src": list(range(6))})
        [req] = poll_until(sender.incoming)
        assert req.num_tokens == 6 and req.meta == {"src": list(range(6))}
        receiver.close()  # its heartbeats stop, as when the process dies
        t0 = time.monotonic()
        [(tid, status)] = poll_until(sender.finished)
        assert tid == req.transfer_id and status.state is TransferState.FAILED
        assert "decode instance went silent" in status.reason
        assert time.monotonic() - t0 < HEARTBEAT["heartbeat_timeout"] + 2
        assert sender.stats.failures == {"peer_lost": 1}
        with pytest.raises(TransferError, match="unknown or has ended"):
            sender.push(tid, torch.arange(6))
    finally:
        sender.close()


# Last, as it kills the shared peer (the fixture would start another for a later test).
def test_a_prefill_that_dies_mid_transfer_fails_it_within_the_heartbeat(peer, receiver_for):
    pool, receiver = receiver_for()
    dst = torch.arange(20, 30)
    meta = {"src": list(range(10)), "mode": "die_after", "n": 4}
    tid = receiver.request(peer.endpoints["f32"], dst, meta, b"", 60.0)
    peer.proc.join(30)
    assert peer.proc.exitcode == 3
    t0 = time.monotonic()
    status = wait_end(receiver, tid)
    assert status.state is TransferState.FAILED and "went silent" in status.reason
    assert time.monotonic() - t0 < HEARTBEAT["heartbeat_timeout"] + 2
    assert status.tokens == 4  # what landed before it died, in every layer
    assert receiver.stats.failures == {"peer_lost": 1}
    assert untouched(pool, dst[:4])


def test_peer_health_skips_a_dead_peer_and_probes_it_in_the_background():
    from concurrent.futures import Future

    from radixserve.disagg.peer_health import PeerHealth

    now, probes = [0.0], []

    def probe(peer: str) -> Future:
        probes.append(Future())
        return probes[-1]

    health = PeerHealth(probe, first_backoff=1.0, max_backoff=4.0, clock=lambda: now[0])
    peer = "tcp://127.0.0.1:9"
    health.failed(peer, "timeout", "slow")  # one transfer's trouble, not the peer's
    assert health.usable(peer)
    health.failed(peer, "connect", "no handshake answer")
    health.failed(peer, "peer_lost", "the same outage, seen by another transfer")
    assert not health.usable(peer) and not probes  # backing off: no probe yet
    now[0] = 1.5
    assert not health.usable(peer) and len(probes) == 1  # probing; requests go local
    assert not health.usable(peer) and len(probes) == 1  # one probe at a time
    probes[0].set_exception(TransferError("no handshake answer"))
    now[0] = 2.0
    assert not health.usable(peer)  # the probe failed: back off 2 s now
    now[0] = 3.9
    assert not health.usable(peer) and len(probes) == 1
    now[0] = 4.1
    assert not health.usable(peer) and len(probes) == 2
    probes[1].set_result("layout")
    assert health.usable(peer) and health.down() == []
    health.failed(peer, "handshake", "refused")
    health.ok(peer)  # a transfer completed after all
    assert health.usable(peer)


def test_float_layers_cross_the_wire_as_int8_rows():
    """An int8 pool keeping layer 1 in float32 sends int8 rows for every layer: the int8
    layers land bit for bit, the float layer as its int8 encoding decodes, in a message per
    layer group; the layout names the wire's format, so a plain int8 peer reads it too."""
    from radixserve.cache.kv_format import KVFormat
    from radixserve.cache.kv_pool import KVPool, KVShape

    int8 = KVFormat.of("int8")
    shape = KVShape(3, 2, 16, torch.float32, kv_format=int8, float_layers=(1,))
    torch.manual_seed(0)
    source, target = KVPool(shape, 32), KVPool(shape, 32)
    for layer in range(3):
        k = torch.randn(32, 2, 16) * 20
        source.write(layer, torch.arange(32), k, torch.randn_like(k))
    layout = layout_of(source)
    assert layout.kv_format == "int8g16" and layout.bytes_per_token() == 3 * 2 * 2 * (16 + 2)
    src, dst = torch.arange(4, 12), torch.arange(20, 28)
    for lo, hi in wire.layer_groups(layout, len(src), 2 * 8 * 2 * 18):
        k_buf, v_buf = wire.gather(source, src, lo, hi)
        wire.scatter(target, dst, lo, hi, bytearray(k_buf), bytearray(v_buf), layout)
    assert torch.equal(target.k[:, :, dst], source.k[:, :, src])
    assert torch.equal(target.v[:, :, dst], source.v[:, :, src])
    for ours, theirs in ((target.fk, source.fk), (target.fv, source.fv)):
        assert torch.equal(ours[:, :, dst], int8.decode(int8.encode(theirs[:, :, src]), 16,
                                                         torch.float32))  # fmt: skip
