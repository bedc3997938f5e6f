"""The request KV ledger and the tier-shaped cache interface.

- ``release`` frees everything up to ``allocated``: a failure or abort between ``schedule()``
  and the end of a step leaks no slot, and the engine goes on serving.
- A failing forward pass fails that step's requests; a failing sampler row fails its request
  alone; both end with ``finish_reason == "error"`` and a short message.
- ``peek_prefix`` agrees with ``match_prefix`` and changes nothing (no split, no LRU touch).
- ``NullCache`` answers the same calls as ``RadixCache``; the engine's stats are typed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import SamplingParams
from radixserve.cache import NullCache, PagedAllocator, RadixCache
from radixserve.engine.stats import EngineStats
from testing.cache import cache_sequence

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
RNG = np.random.default_rng(11)


def ids(n: int) -> list[int]:
    return RNG.integers(100, 40000, n).tolist()


def drain(engine, limit: int = 2000) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def test_release_frees_slots_allocated_but_never_computed(make_engine):
    engine = make_engine(chunked_prefill_size=16, page_size=4)
    engine.add_request("a", ids(40), GREEDY)
    step = engine.scheduler.schedule()  # allocates the first chunk; no forward pass follows
    [(req, n)] = step.prefills
    assert (req.kv.cached, req.kv.computed, req.kv.allocated) == (0, 0, 16) and n == 16
    engine.abort_request("a")
    assert engine.stats().kv_used_tokens == 0
    engine.check_integrity()


def test_forward_failure_fails_the_step_and_the_engine_goes_on(make_engine, monkeypatch):
    engine = make_engine(chunked_prefill_size=32)
    shared = ids(24)
    engine.add_request("ok-1", shared + ids(5), GREEDY)
    drain(engine)  # cache the shared head
    engine.add_request("doomed-1", shared + ids(30), GREEDY)
    engine.add_request("doomed-2", ids(20), GREEDY)
    real_forward = engine.model.forward

    def broken(batch, pool):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.model, "forward", broken)
    outs = engine.step()
    assert {o.request_id for o in outs} == {"doomed-1", "doomed-2"}
    assert all(o.finished and o.finish_reason == "error" for o in outs)
    assert all(o.error and "RuntimeError" in o.error and "simulated" not in o.error for o in outs)
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.stats().cached_tokens >= 24  # nothing already cached was lost
    monkeypatch.setattr(engine.model, "forward", real_forward)
    engine.add_request("after", shared + ids(5), GREEDY)
    outs = drain(engine)["after"]
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 8
    assert outs[-1].usage.cached_tokens >= 24


def test_a_request_whose_sampling_fails_fails_alone(make_engine):
    engine = make_engine()
    reference = make_engine()
    good = ids(12)
    reference.add_request("good", good, SamplingParams(temperature=0.8, max_tokens=6, seed=3))
    expected = [t for o in drain(reference)["good"] for t in o.new_token_ids]
    engine.add_request("good", good, SamplingParams(temperature=0.8, max_tokens=6, seed=3))
    bad = engine.add_request("bad", ids(12), SamplingParams(temperature=1.0, max_tokens=6))
    bad.params.top_p = None  # as if validation had been bypassed: no tensor can hold it
    outs = drain(engine)
    assert outs["bad"][-1].finish_reason == "error"
    assert [t for o in outs["good"] for t in o.new_token_ids] == expected
    engine.check_integrity()


def test_engine_stats_are_a_typed_snapshot(make_engine):
    engine = make_engine(max_total_tokens=512)
    engine.add_request("a", ids(30), GREEDY)
    drain(engine)
    stats = engine.stats()
    assert isinstance(stats, EngineStats)
    assert stats.kv_capacity_tokens == 512 and stats.num_running == stats.num_waiting == 0
    assert stats.cached_tokens == stats.kv_used_tokens == 37  # 30 prompt + 7 computed outputs
    assert stats.kv_available_tokens == 512 and stats.kv_usage == 0.0
    assert stats.cache.lookups == 1 and stats.cache.lookup_tokens == 30
    info = engine.info()
    assert info.kv_capacity_tokens == 512 and info.prefix_caching and info.dtype == "float32"


def test_peek_agrees_with_match_and_changes_nothing():
    alloc = PagedAllocator(256)
    cache = RadixCache(alloc)
    cache_sequence(cache, alloc, [7, 7])  # the least recently used leaf
    cache_sequence(cache, alloc, [1, 2, 3, 4, 5])
    cache_sequence(cache, alloc, [8, 8])
    nodes = cache.summary().num_nodes
    peek = cache.peek_prefix([1, 2, 3, 9])
    assert peek.length == 3 and len(peek.path) == 2  # the root, then the edge it ends inside
    assert cache.summary().num_nodes == nodes  # no split
    cache.peek_prefix([7, 7])  # no LRU touch: [7, 7] is still the oldest leaf
    assert cache.evict(1) == 2 and cache.match_prefix([7, 7]).device_len == 0
    assert cache.peek_prefix([1, 2, 3, 9]).length == cache.match_prefix([1, 2, 3, 9]).device_len
    assert cache.peek_prefix([1, 2], namespace="other").length == 0


def test_null_cache_answers_every_call():
    alloc = PagedAllocator(64)
    cache = NullCache(alloc)
    assert not cache.reuses_prefixes and cache.peek_prefix([1, 2, 3]).length == 0
    m = cache.match_prefix([1, 2, 3])
    assert (m.device_len, m.host_len, m.storage_len, m.total_len) == (0, 0, 0, 0)
    cache.inc_lock_ref(m.handle)
    cache.dec_lock_ref(m.handle)
    assert cache_sequence(cache, alloc, [1, 2, 3]) == 0 and alloc.free_size() == 64
    cache.check_integrity(torch.empty(0, dtype=torch.int64))


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_policies_only_peek(make_engine, policy):
    engine = make_engine(schedule_policy=policy, max_running_requests=1)
    head = ids(30)
    engine.add_request("warm", head + ids(3), GREEDY)
    drain(engine)
    nodes = engine.cache_summary().num_nodes
    for i in range(4):
        engine.add_request(f"r{i}", head[: 10 + 5 * i] + ids(4), GREEDY)
    engine.scheduler.schedule()  # orders 4 waiting requests, admits one
    # only the admitted request's match may split the tree: one edge, at most one new node
    assert engine.cache_summary().num_nodes <= nodes + 1
