"""Eviction policies: the order each one evicts in, on small trees built by hand.

The hypothesis machine in test_radix_properties.py checks every policy against a from-scratch
minimum after random operations; these tests pin what each policy means.
"""

import pytest

from radixserve.cache import PagedAllocator, RadixCache
from radixserve.cache.eviction import CostAwarePolicy, make_policy
from radixserve.cli import build_parser
from radixserve.cli_options import engine_config_from_args
from radixserve.config import EngineConfig
from testing.cache import cache_sequence, evict_order


def make(policy="lru", threshold=None, capacity=256):
    alloc = PagedAllocator(capacity, 1)
    return RadixCache(alloc, policy, cache_threshold=threshold), alloc


def admit(cache, tokens):
    """What admission does: match (recording a hit on the matched path)."""
    return cache.match_prefix(tokens)


def test_lru_evicts_least_recent_and_lfu_least_hit():
    for policy, expected in (("lru", [10, 20, 30]), ("lfu", [30, 20, 10])):
        cache, alloc = make(policy)
        for first in (10, 20, 30):
            cache_sequence(cache, alloc, [first, 1, 2])
        for _ in range(2):
            admit(cache, [10, 1, 2, 9])
        admit(cache, [20, 1, 2, 9])
        cache.match_prefix([30, 1, 2], record_stats=False)  # most recent, never hit
        assert evict_order(cache) == expected, policy


def test_threshold_evicts_low_reuse_first_and_catches_silent_decay():
    # LFU alone would evict the never-hit node 30 first; under the threshold the node whose
    # reuse rate decayed below it with no event on itself goes first.
    cache, alloc = make("lfu", threshold=0.25)
    cache_sequence(cache, alloc, [10, 1, 2])  # cached at admission count 1
    for _ in range(2):
        admit(cache, [10, 1, 2, 9])  # 2 hits
    for _ in range(7):
        admit(cache, [99])  # admissions elsewhere: rate 2 / 9 < 0.25, no event on node 10
    cache_sequence(cache, alloc, [30, 1, 2])  # fresh: no admission since, so not below
    leaf10 = cache.match_prefix([10, 1, 2], record_stats=False).handle
    assert (leaf10.created, leaf10.hit_count) == (1, 2)
    assert evict_order(cache) == [10, 30]


def test_threshold_crossing_is_exact():
    # created at c with h hits, R = 1/4: still at the threshold at A = c + 4h, below at c + 4h + 1.
    cache, alloc = make("lru", threshold=0.25)
    cache_sequence(cache, alloc, [10, 1])  # admission 1 happens in cache_sequence
    node = cache.match_prefix([10, 1], record_stats=False).handle
    c = node.created
    admit(cache, [10, 1, 5])
    cache_sequence(cache, alloc, [20, 1])  # a younger node, LRU-first only if 10 is below
    while cache.admissions < c + 4 * node.hit_count:
        admit(cache, [99])
    assert cache._heap.priority(node)[0] == 1  # rate == R exactly: not below
    admit(cache, [99])
    assert cache._heap.priority(node)[0] == 0
    assert evict_order(cache) == [10, 20]


def test_slru_protects_reused_nodes_and_caps_the_protected_segment():
    cache, alloc = make("slru")
    for first in (10, 20, 30, 40):
        cache_sequence(cache, alloc, [first, 1, 2, 3])
    admit(cache, [10, 1, 2, 3, 9])  # 10 reused: protected
    cache_sequence(cache, alloc, [50, 1, 2, 3])  # newest, on probation
    assert evict_order(cache) == [20, 30, 40, 50, 10]

    cache, alloc = make("slru")
    for first in (10, 20, 30, 40, 50):
        cache_sequence(cache, alloc, [first, 1, 2, 3])
    for first in (10, 20, 30, 40, 50):  # all reused: 100% protected > 80% cap
        admit(cache, [first, 1, 2, 3, 9])
    policy = cache._heap.policy
    assert policy.protected_tokens <= 0.8 * cache.total_size()
    # the least recently used protected node was demoted to probation and goes first
    assert evict_order(cache)[0] == 10


def test_cost_aware_keeps_deep_prefixes_and_ages():
    cache, alloc = make("cost-aware", capacity=40_000)
    policy = cache._heap.policy
    assert isinstance(policy, CostAwarePolicy)
    policy.context_scale = 100.0
    cache_sequence(cache, alloc, [7] * 400 + [1, 2])  # a deep branch: costly to recompute
    cache_sequence(cache, alloc, [7] * 400 + [3, 4])
    cache_sequence(cache, alloc, [5, 6])  # shallow, cached last (LRU would keep it)
    assert evict_order(cache)[0] == 5
    assert policy.inflation > 0  # L rose to the evicted values

    # an old favourite ages out: hit often long ago, then newer nodes keep being evicted
    cache, alloc = make("cost-aware", capacity=64)
    cache_sequence(cache, alloc, [10, 1])
    for _ in range(3):
        admit(cache, [10, 1, 5])
    for first in range(20, 60):
        cache_sequence(cache, alloc, [first, 1, 2, 3, 4, 5, 6])
    assert cache.match_prefix([10, 1, 5], record_stats=False).device_len == 0


def test_policies_by_name_and_bad_values():
    for name in ("lru", "lfu", "slru", "cost-aware"):
        assert make_policy(name).name == name
    assert make_policy("lru", 0.2).name == "lru+threshold=0.2"
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make_policy("mru")
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="cache_threshold must be in"):
            EngineConfig.from_options(cache_threshold=bad)


def test_serve_flags_select_policy_and_threshold():
    parser = build_parser()
    args = parser.parse_args(
        ["generate", "x", "--eviction-policy", "slru", "--cache-threshold", "0.2"]
    )
    sub = args.parser
    config = engine_config_from_args(sub, args)
    assert (config.cache.eviction_policy, config.cache.cache_threshold) == ("slru", 0.2)
    bad = parser.parse_args(["generate", "x", "--cache-threshold", "3"])
    with pytest.raises(SystemExit):
        engine_config_from_args(bad.parser, bad)


def test_engine_builds_its_tree_with_the_policy(make_engine):
    engine = make_engine(eviction_policy="cost-aware", cache_threshold=0.3)
    assert engine.cache.eviction_policy == "cost-aware+threshold=0.3"
