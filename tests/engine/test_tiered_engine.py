"""The engine with the hierarchical cache (tiny random Llama, float32, greedy).

- Greedy output is identical whether a prompt's prefix came from the device, the host tier,
  a file store or Redis (a real valkey-server on a free port), or was computed; each hit is
  counted on the tier it came from.
- Bad storage: a corrupt or truncated page file, a Redis that is down, one that hangs. Each
  is a logged warning and a recomputation (same output), never a crash or a hang; a request
  waits for a slow prefetch only ``storage_prefetch_timeout`` seconds.
- The slot ledgers and both pools pass ``check_integrity`` after every scenario.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from radixserve import SamplingParams
from testing.redis_server import RedisServer

PAGE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
RNG = np.random.default_rng(5)
SHARED = RNG.integers(100, 40000, 10 * PAGE).tolist()  # 160 tokens: 10 pages
TAILS = [RNG.integers(100, 40000, 7).tolist() for _ in range(3)]
# a stored block per page: the storage tests below count pages
TIERS = dict(page_size=PAGE, max_total_tokens=16 * PAGE, host_kv_memory="1MiB",
             chunked_prefill_size=64, load_back_min_tokens=PAGE,
             kv_storage_block_tokens=PAGE)  # fmt: skip


def filler(i: int) -> list[int]:
    return np.random.default_rng(100 + i).integers(100, 40000, 9 * PAGE).tolist()


def run(engine, prompt: list[int], rid: str):
    """Run one request to the end; its final output and every token."""
    engine.add_request(rid, prompt, GREEDY)
    tokens, last = [], None
    for _ in range(500):
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                last = out
        if last is not None and last.finished:
            engine.check_integrity()
            return last, tokens
    raise AssertionError("the request did not finish")


@pytest.fixture(scope="module")
def reference(tiny_loaded):
    """What the model answers with no cache at all."""
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine

    engine = Engine(
        EngineConfig.from_options(
            load_progress=False, enable_prefix_caching=False, max_total_tokens=1024
        ),
        tiny_loaded,
    )
    return {i: run(engine, SHARED + t, f"ref{i}")[1] for i, t in enumerate(TAILS)}


@pytest.fixture
def engines(make_engine):
    """Like make_engine; every engine it made is closed (storage threads stopped) after."""
    made = []

    def make(**options):
        engine = make_engine(**{**TIERS, **options})
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_device_and_host_hits_give_the_computed_answer(engines, reference):
    engine = engines(write_policy="write_through")
    out, tokens = run(engine, SHARED + TAILS[0], "a")
    assert out.usage.cached_tokens == 0 and tokens == reference[0]
    out, tokens = run(engine, SHARED + TAILS[1], "b")  # the prefix is on the device
    assert out.usage.cached_tokens >= len(SHARED) and out.usage.host_cached_tokens == 0
    assert tokens == reference[1]
    for i in range(2):  # push the prefix off the device (the pool holds 256 tokens)
        run(engine, filler(i), f"fill{i}")
    out, tokens = run(engine, SHARED + TAILS[2], "c")
    assert (
        out.usage.host_cached_tokens >= len(SHARED) - PAGE and out.usage.storage_cached_tokens == 0
    )
    assert tokens == reference[2]
    stats = engine.stats()
    assert stats.tiers.loads >= 1 and stats.tiers.pages_to_device >= 9
    assert stats.cache.host_hit_tokens == out.usage.host_cached_tokens
    assert stats.tiers.host_cached_tokens > 0
    engine.flush_cache()  # empties both tiers
    stats = engine.stats()
    assert stats.cached_tokens == 0 and stats.tiers.host_cached_tokens == 0


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_other_write_policies_also_serve_from_the_host(engines, reference, policy):
    engine = engines(write_policy=policy)
    run(engine, SHARED + TAILS[0], "a")
    run(engine, SHARED + TAILS[1], "b")  # a reuse: selective copies the prefix now
    for i in range(2):
        run(engine, filler(i), f"fill{i}")
    out, tokens = run(engine, SHARED + TAILS[2], "c")
    assert out.usage.host_cached_tokens >= len(SHARED) - PAGE
    assert tokens == reference[2]


def test_a_short_host_hit_is_computed_not_loaded(engines, reference):
    engine = engines(write_policy="write_through", load_back_min_tokens=100 * PAGE)
    run(engine, SHARED + TAILS[0], "a")
    for i in range(2):
        run(engine, filler(i), f"fill{i}")
    out, tokens = run(engine, SHARED + TAILS[1], "b")
    assert out.usage.cached_tokens == 0 and tokens == reference[1]
    assert engine.stats().tiers.loads == 0


def storage_round_trip(engines, url: str, reference, **options) -> tuple:
    """Engine 1 computes the prefix and writes it out; engine 2, fresh, fetches it."""
    first = engines(kv_storage=url, **options)
    run(first, SHARED + TAILS[0], "a")
    first.close()  # drains the write-outs
    second = engines(kv_storage=url, **options)
    out, tokens = run(second, SHARED + TAILS[1], "b")
    assert tokens == reference[1]
    return out, second


def test_a_file_store_serves_a_fresh_engine(engines, reference, tmp_path):
    out, engine = storage_round_trip(engines, f"file://{tmp_path}", reference)
    assert out.usage.storage_cached_tokens >= len(SHARED) - PAGE
    assert out.usage.cached_tokens == out.usage.storage_cached_tokens  # nothing else was cached
    tiers = engine.stats().tiers
    assert tiers.pages_from_storage >= 9 and tiers.storage.pages_read >= 9


def test_kv_storage_alone_is_a_host_tier_sized_by_default_over_a_directory(
    engines, reference, tmp_path, caplog
):
    with caplog.at_level(logging.INFO, logger="radixserve"):
        out, engine = storage_round_trip(engines, str(tmp_path), reference, host_kv_memory=None)
    assert out.usage.storage_cached_tokens >= len(SHARED) - PAGE
    assert engine.config.tiers.kv_storage == f"file://{tmp_path}"  # a plain path is a file store
    assert engine.config.tiers.write_policy == "write_through"
    sized = [r.getMessage() for r in caplog.records if "sized by default" in r.getMessage()]
    assert len(sized) == 2  # each engine logged the size it chose
    assert engine.stats().tiers.host_capacity_tokens > engine.config.cache.max_total_tokens
    engine.check_integrity()


@pytest.mark.parametrize("page_size", [1, PAGE])
def test_storage_keeps_blocks_of_64_tokens_whatever_the_page_size(
    engines, reference, tmp_path, page_size
):
    options = dict(page_size=page_size, kv_storage_block_tokens=64, load_back_min_tokens=1)
    out, engine = storage_round_trip(engines, str(tmp_path), reference, **options)
    blocks = (len(SHARED) + len(TAILS[0]) - 1) // 64  # whole blocks of the first prompt
    assert len(list(Path(tmp_path).rglob("*.kv"))) == blocks == 2  # not one file per page
    assert out.usage.storage_cached_tokens == blocks * 64  # the shared prefix's whole blocks
    tiers = engine.stats().tiers
    assert tiers.storage.pages_read == blocks
    assert tiers.pages_from_storage == blocks * 64 // page_size  # host pages filled
    engine.check_integrity()


def test_a_request_waiting_for_its_pages_holds_up_no_other(engines, reference, tmp_path):
    first = engines(kv_storage=str(tmp_path))
    run(first, SHARED + TAILS[0], "a")
    first.close()
    second = engines(kv_storage=str(tmp_path), storage_prefetch_timeout=60)
    backend, gate = second.tiers.storage.backend, threading.Event()
    real_exists, calls = backend.exists, []

    def exists(keys):  # a store slow to answer the first lookup: "b"'s
        calls.append(keys)
        if len(calls) == 1:
            gate.wait(60)
        return real_exists(keys)

    backend.exists = exists
    second.add_request("b", SHARED + TAILS[1], GREEDY)  # its lookup hangs in the store
    out, _ = run(second, filler(0), "c")  # admitted, computed and finished meanwhile
    assert out.finished and "b" in second.requests
    assert second.requests["b"].num_computed == 0  # still waiting for its pages
    gate.set()
    tokens, last = [], None
    for _ in range(500):
        for o in second.step():
            tokens += o.new_token_ids if o.request_id == "b" else []
            last = o if o.request_id == "b" else last
        if last is not None and last.finished:
            break
    assert tokens == reference[1]
    assert last.usage.storage_cached_tokens >= len(SHARED) - PAGE  # it got them, then ran
    second.check_integrity()


def test_a_request_whose_pages_storage_lacks_is_admitted_in_its_first_step(
    engines, tmp_path, monkeypatch
):
    """Its storage lookup (nothing found) is answered before the step schedules, so asking
    storage costs it no step of waiting."""
    from radixserve.cache import tier_controller

    monkeypatch.setattr(tier_controller, "LOOKUP_WAIT_S", 5.0)  # a loaded machine: no race
    engine = engines(kv_storage=str(tmp_path))
    engine.add_request("a", SHARED + TAILS[0], GREEDY)
    assert engine.stats().tiers.prefetches_in_flight == 1  # it asked storage
    engine.step()
    assert engine.requests["a"].num_computed > 0  # admitted and computing in this first step
    engine.check_integrity()


def test_redis_serves_another_engine(engines, reference):
    with RedisServer() as redis:
        out, engine = storage_round_trip(engines, redis.url, reference)
    assert out.usage.storage_cached_tokens >= len(SHARED) - PAGE
    assert engine.stats().cache.storage_hit_tokens == out.usage.storage_cached_tokens


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_page_file_is_recomputed(engines, reference, tmp_path, caplog, damage):
    first = engines(kv_storage=f"file://{tmp_path}")
    run(first, SHARED + TAILS[0], "a")
    first.close()
    second = engines(kv_storage=f"file://{tmp_path}")  # scans the store as it was
    files = sorted(Path(tmp_path).rglob("*.kv"), key=os.path.getmtime)
    assert len(files) >= 10
    victim = files[4]  # the fifth page written: the pages before it still count
    data = victim.read_bytes()
    if damage == "corrupt":
        victim.write_bytes(data[:-64] + bytes(b ^ 0xFF for b in data[-64:]))
    else:
        victim.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING):
        out, tokens = run(second, SHARED + TAILS[1], "b")
    assert tokens == reference[1]
    assert 0 < out.usage.storage_cached_tokens <= 4 * PAGE
    assert any("page" in r.getMessage().lower() for r in caplog.records if r.levelno >= 30)


def test_a_redis_that_is_down_costs_a_recomputation(engines, reference, caplog):
    redis = RedisServer().start()
    url = redis.url
    redis.close()  # nobody listens there now
    engine = engines(kv_storage=url)
    with caplog.at_level(logging.WARNING):
        out, tokens = run(engine, SHARED + TAILS[0], "a")
        out, tokens = run(engine, SHARED + TAILS[1], "b")
    assert tokens == reference[1] and out.usage.storage_cached_tokens == 0
    assert any(r.levelno >= 30 for r in caplog.records)


def test_a_redis_outage_counts_write_outs_as_write_errors_and_clear_says_so(engines, reference):
    with RedisServer() as redis:
        engine = engines(kv_storage=redis.url)
        run(engine, SHARED + TAILS[0], "a")
        redis.kill()  # an outage: the next write-outs fail
        before = engine.stats().tiers.storage
        out, tokens = run(engine, filler(0), "b")
        deadline = time.monotonic() + 30
        while engine.stats().tiers.storage.write_errors == before.write_errors:
            assert time.monotonic() < deadline, "failed write-outs were not counted as writes"
            engine.tiers.poll(timeout=0.1)
        result = engine.clear_storage()
        assert not result.cleared and f"127.0.0.1:{redis.port}" in result.reason
        engine.check_integrity()


def test_a_hung_redis_delays_admission_by_the_timeout_only(engines, reference):
    with RedisServer() as redis:
        first = engines(kv_storage=redis.url)
        run(first, SHARED + TAILS[0], "a")
        first.close()
        second = engines(kv_storage=redis.url, storage_prefetch_timeout=0.3)
        os.kill(redis.proc.pid, 19)  # SIGSTOP: the server hangs, connections stay open
        try:
            start = time.monotonic()
            out, tokens = run(second, SHARED + TAILS[1], "b")
            elapsed = time.monotonic() - start
            # the store still hangs: the next request does not wait for it again
            out2, tokens2 = run(second, SHARED + TAILS[2], "c")
        finally:
            os.kill(redis.proc.pid, 18)  # SIGCONT, so the server can be stopped
    assert tokens == reference[1] and out.usage.storage_cached_tokens == 0
    assert tokens2 == reference[2]
    assert second.stats().tiers.prefetch_timeouts == 1
    assert elapsed < 30  # waited 0.3 s for its pages, then computed them


def test_storage_writes_are_kv_events_of_medium_storage(engines, tmp_path):
    engine = engines(kv_storage=f"file://{tmp_path}", enable_kv_events=True)
    run(engine, SHARED + TAILS[0], "a")
    deadline = time.monotonic() + 30
    media: set[str] = set()
    while "storage" not in media and time.monotonic() < deadline:
        engine.tiers.poll(timeout=0.1)
        media |= {getattr(e, "medium", None) for e in engine.kv_events.drain()}
    assert {"device", "host", "storage"} <= media


def test_write_outs_ending_after_the_last_request_are_applied_while_idle(engines, tmp_path):
    """The last request's pages reach storage after its last step; with nothing left to run,
    ``apply_finished_transfers`` (what an idle engine loop calls) counts them and unpins
    their host pages, without another step."""
    engine = engines(kv_storage=f"file://{tmp_path}")
    run(engine, SHARED + TAILS[0], "a")
    assert not engine.has_unfinished()
    deadline = time.monotonic() + 30
    while engine.stats().tiers.pages_to_storage < len(SHARED) // PAGE:
        assert time.monotonic() < deadline, "finished write-outs were never applied"
        engine.apply_finished_transfers()
        time.sleep(0.05)
    engine.check_integrity()


def test_storage_writes_landing_after_events_went_off_are_dropped_not_a_crash(engines, tmp_path):
    """A subscriber leaves (events off) while write-outs announced as events are under way:
    they land without an event, and a later subscriber gets a fresh snapshot."""
    engine = engines(kv_storage=f"file://{tmp_path}", enable_kv_events=True)
    backend, gate = engine.tiers.storage.backend, threading.Event()
    real_set = backend.set
    backend.set = lambda keys, pages: gate.wait(30) and real_set(keys, pages)
    run(engine, SHARED + TAILS[0], "a")  # write-outs queued, their events pending
    engine.set_kv_events(False)
    gate.set()
    deadline = time.monotonic() + 30
    while engine.stats().tiers.pages_to_storage < len(SHARED) // PAGE:
        assert time.monotonic() < deadline, "the write-outs never landed"
        engine.tiers.poll(timeout=0.1)  # lands them, with no event to announce
    assert engine.drain_kv_events() == []
    engine.set_kv_events(True)
    events = engine.drain_kv_events()
    assert type(events[0]).__name__ == "AllBlocksCleared" and len(events) > 1
    run(engine, SHARED + TAILS[1], "b")
    engine.check_integrity()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(host_kv_memory="1KiB"), "host tier must be larger than the device pool"),
        (dict(host_kv_memory=None, write_policy="write_back"), "needs a host tier"),
        (dict(kv_storage="ftp://host/x"), "use file:///absolute/path or redis://"),
        (dict(kv_storage="file://relative/path"), "three slashes"),
        (dict(kv_storage_size="1MiB"), "kv_storage_size needs kv_storage"),
        (dict(write_policy="write_around"), "unknown write_policy"),
        (dict(storage_prefetch_timeout=0), "storage_prefetch_timeout must be positive"),
    ],
)
def test_bad_tier_options_are_clear_errors(make_engine, options, message):
    with pytest.raises(ValueError, match=message):
        make_engine(**{**TIERS, **options})
