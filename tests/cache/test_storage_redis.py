"""The Redis storage backend against a real server (valkey-server) on a free loopback port."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import redis
import torch

from radixserve.cache.storage import StorageScope, TensorPages, open_backend
from radixserve.cache.storage.redis_backend import RedisBackend
from testing.redis_server import RedisServer
from testing.storage import (
    LAYOUT,
    SCOPE,
    WINDOW_SCOPE,
    check_window_round_trip,
    keys_for,
    random_pages,
)


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def backend(server):
    b = open_backend(server.url, SCOPE)
    b.clear()
    yield b
    b.clear()
    b.close()


def raw(server) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)


def command_calls(server, name: str) -> int:
    stats = raw(server).info("commandstats").get(f"cmdstat_{name}", {})
    return int(stats.get("calls", 0))


def test_round_trip_is_bit_exact_and_one_read_is_one_mget(server, backend):
    keys, src = keys_for(6), random_pages(6)
    assert backend.exists(keys) == 0
    assert backend.set(keys, src) == 6
    dst = TensorPages.empty(LAYOUT, 6)
    before = command_calls(server, "mget")
    assert backend.get(keys, dst) == 6
    assert command_calls(server, "mget") == before + 1
    assert torch.equal(dst.tensor, src.tensor)
    s = backend.stats()
    assert (s.pages_written, s.pages_read, s.bytes_read) == (6, 6, 6 * LAYOUT.record_nbytes)


def test_pages_with_and_without_window_kv_round_trip_with_their_flag(server):
    backend = open_backend(server.url, WINDOW_SCOPE)
    try:
        check_window_round_trip(backend)
    finally:
        backend.clear()
        backend.close()


def test_large_batches_are_split_by_bytes(server):
    b = RedisBackend(SCOPE, port=server.port, max_batch_bytes=2 * LAYOUT.record_nbytes)
    keys, src = keys_for(5, first_token=7), random_pages(5)
    assert b.set(keys, src) == 5
    before = command_calls(server, "mget")
    dst = TensorPages.empty(LAYOUT, 5)
    assert b.get(keys, dst) == 5 and torch.equal(dst.tensor, src.tensor)
    assert command_calls(server, "mget") == before + 3
    b.clear()


def test_exists_and_get_count_leading_pages_only(backend):
    keys, src = keys_for(4), random_pages(4)
    backend.set(keys[:2], src)
    backend.set(keys[3:], TensorPages(src.tensor[3:]))
    assert backend.exists(keys) == 2
    dst = TensorPages.empty(LAYOUT, 4)
    assert backend.get(keys, dst) == 2
    assert torch.equal(dst.tensor[:2], src.tensor[:2])
    assert backend.stats().get_misses == 1


def test_clear_deletes_only_our_prefix(server, backend):
    other = open_backend(server.url, StorageScope("another-model", LAYOUT))
    r = raw(server)
    r.set(b"someone-elses-key", b"keep me")
    backend.set(keys_for(3), random_pages(3))
    other.set(keys_for(2, other.scope), random_pages(2))
    backend.clear()
    assert backend.exists(keys_for(3)) == 0
    assert other.exists(keys_for(2, other.scope)) == 2
    assert r.get(b"someone-elses-key") == b"keep me"
    assert all(name.startswith(b"rxkv:") for name in r.scan_iter() if name != b"someone-elses-key")
    other.clear()
    r.delete(b"someone-elses-key")


def test_two_instances_share_pages(server, backend):
    second = open_backend(server.url, SCOPE)  # its own client and connections
    keys, src = keys_for(3), random_pages(3)
    backend.set(keys, src)
    dst = TensorPages.empty(LAYOUT, 3)
    assert second.exists(keys) == 3 and second.get(keys, dst) == 3
    assert torch.equal(dst.tensor, src.tensor)


def test_corrupt_value_is_refused_and_deleted(server, backend, caplog):
    keys = keys_for(3)
    backend.set(keys, random_pages(3))
    name = backend.prefix + keys[1].hex().encode()
    r = raw(server)
    r.setrange(name, LAYOUT.record_nbytes - 3, b"\xff\xff\xff")
    with caplog.at_level(logging.WARNING):
        assert backend.get(keys, TensorPages.empty(LAYOUT, 3)) == 1
    assert "checksum" in caplog.text and not r.exists(name)
    assert backend.stats().corrupt_pages == 1


def test_a_server_out_of_memory_gives_a_short_count(server, backend, caplog):
    r = raw(server)
    r.config_set("maxmemory-policy", "noeviction")
    room = 64 * 1024  # ~100 pages of 560 bytes; 300 do not fit
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + room))
    try:
        with caplog.at_level(logging.WARNING):
            stored = backend.set(keys_for(300), random_pages(300))
        assert 0 < stored < 300
        assert "refused" in caplog.text and backend.stats().write_errors == 1
        assert backend.exists(keys_for(300)) == stored
    finally:
        r.config_set("maxmemory", "0")
        r.config_set("maxmemory-policy", "noeviction")


def test_server_down_from_the_start_answers_zero_at_once(caplog):
    with RedisServer() as srv:
        port = srv.port
    b = RedisBackend(SCOPE, port=port, reconnect_interval=60)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert b.exists(keys_for(2)) == 0
        assert b.set(keys_for(2), random_pages(2)) == 0  # backing off: no second attempt
        assert b.get(keys_for(2), TensorPages.empty(LAYOUT, 2)) == 0
    assert time.monotonic() - t0 < 3
    assert caplog.text.count("failed") == 1  # one warning, not one per call
    s = b.stats()  # every call failed, the ones refused at once while backing off too
    assert (s.read_errors, s.write_errors) == (2, 1)


def test_killed_mid_run_then_recovers_on_the_same_port(caplog):
    keys, src = keys_for(4), random_pages(4)
    with RedisServer() as srv:
        b = RedisBackend(SCOPE, port=srv.port, socket_timeout=1, reconnect_interval=0.2)
        assert b.set(keys, src) == 4
        srv.kill()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert b.get(keys, TensorPages.empty(LAYOUT, 4)) == 0
            assert b.exists(keys) == 0
            assert b.set(keys, src) == 0
        assert time.monotonic() - t0 < 3
        assert "failed" in caplog.text
        srv.start()  # a new, empty server on the same port
        time.sleep(0.25)  # past the back-off
        assert b.exists(keys) == 0  # reconnected; the dead server's pages are gone
        assert b.set(keys, src) == 4
        dst = TensorPages.empty(LAYOUT, 4)
        assert b.get(keys, dst) == 4 and torch.equal(dst.tensor, src.tensor)
        b.close()


def test_a_hung_server_costs_one_timeout_not_a_hang(caplog):
    keys, src = keys_for(2), random_pages(2)
    with RedisServer() as srv:
        b = RedisBackend(SCOPE, port=srv.port, socket_timeout=0.3, reconnect_interval=30)
        assert b.set(keys, src) == 2
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING):
                assert b.get(keys, TensorPages.empty(LAYOUT, 2)) == 0
                assert b.exists(keys) == 0  # backing off: answered at once
            assert time.monotonic() - t0 < 2
            assert "Timeout" in caplog.text or "timed out" in caplog.text
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        b.close()


def test_a_write_out_that_fails_counts_as_a_write_error():
    """A write-out asks which pages are stored already, then sets the rest: with the store
    down, both halves are the write failing (never a read error)."""
    with RedisServer() as srv:
        b = RedisBackend(SCOPE, port=srv.port, socket_timeout=1, reconnect_interval=60)
        srv.kill()
        for first in (1, 50):  # the first meets the dead server, the second its back-off
            keys = keys_for(2, first_token=first)
            assert b.exists(keys, writing=True) == 0
            assert b.set(keys, random_pages(2)) == 0
        s = b.stats()
        assert s.write_errors == 4 and s.read_errors == 0
        b.close()


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_clear_says_when_nothing_was_deleted(fault):
    keys = keys_for(3)
    with RedisServer() as srv:
        b = RedisBackend(SCOPE, port=srv.port, socket_timeout=0.5, reconnect_interval=0.2)
        assert b.set(keys, random_pages(3)) == 3
        if fault == "killed":
            srv.kill()
        else:
            os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            result = b.clear()
            assert time.monotonic() - t0 < 5
        finally:
            if fault == "hung":
                os.kill(srv.proc.pid, signal.SIGCONT)
        assert not result.cleared and f"127.0.0.1:{srv.port}" in result.reason
        assert b.stats().write_errors == 1
        if fault == "hung":  # the pages are all still there, and a working clear says so
            assert raw(srv).exists(*[b.prefix + k.hex().encode() for k in keys]) == 3
            time.sleep(0.25)
            assert b.clear().cleared and b.exists(keys) == 0
        b.close()
