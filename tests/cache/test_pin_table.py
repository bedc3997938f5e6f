"""Pins (cache/pins.py): a pinned prefix survives eviction pressure, budgets (server and
tenant) hold, pins expire on the table's clock and refresh on reuse, and a pin put out by a
newer one over budget goes to the host tier when there is one. Integrity is checked after
every scenario (the tree's and the pin table's own bookkeeping)."""

from __future__ import annotations

import pytest
import torch

from radixserve.cache import KVPool, KVShape, PagedAllocator
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.pins import PinTable
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tier_controller import TierController
from testing.cache import cache_sequence

NO_HELD = torch.empty(0, dtype=torch.int64)
SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def make(slots: int, budget: int, tenant_budget: int | None = None, host: int = 0):
    alloc = PagedAllocator(slots, 1)
    cache = RadixCache(alloc)
    backup = None
    if host:
        pool = KVPool(SHAPE, alloc.num_slots)
        backup = TierController(cache, HostKVPool(pool, host, 1), "write_back").backup
    clock = Clock()
    return cache, alloc, PinTable(cache, budget, tenant_budget, clock, backup), clock


def cached_len(cache: RadixCache, tokens: list[int], ns=None) -> int:
    return cache.match_prefix(tokens, ns, record_stats=False).device_len


def test_pinned_prefix_survives_pressure_that_evicts_the_rest():
    cache, alloc, pins, _ = make(slots=1000, budget=300)
    system = seq(10_000, 200)
    cache_sequence(cache, alloc, system + seq(0, 50))
    assert pins.pin(system, None, "a", 300) is not None
    for i in range(40):  # 40 x 100 new tokens through a 1000-slot pool
        assert cache_sequence(cache, alloc, seq(20_000 + 1000 * i, 100)) is not None
    assert cache.stats.evicted_tokens > 3000
    assert cached_len(cache, system) == 200
    assert cached_len(cache, system + seq(0, 50)) == 200  # the unpinned tail went
    assert pins.stats.pinned_tokens == 200 and cache.protected_size() == 200
    cache.check_integrity(NO_HELD)


def test_unpinned_prefix_is_evicted_under_the_same_pressure():
    cache, alloc, _, _ = make(slots=1000, budget=300)
    system = seq(10_000, 200)
    cache_sequence(cache, alloc, system)
    for i in range(40):
        cache_sequence(cache, alloc, seq(20_000 + 1000 * i, 100))
    assert cached_len(cache, system) == 0


def test_nested_pins_count_shared_tokens_once_and_repinning_refreshes():
    cache, alloc, pins, clock = make(slots=1000, budget=500)
    convo = seq(0, 300)
    cache_sequence(cache, alloc, convo)
    first = pins.pin(convo[:100], None, "a", 300)
    pins.pin(convo, None, "a", 300)
    assert pins.stats.pins == 2 and pins.stats.pinned_tokens == 300
    assert pins.stats.tenant_tokens == {"a": 300}
    clock.now += 200
    again = pins.pin(convo[:100], None, "a", 300)
    assert again is first and first.expires_at == clock.now + 300
    cache.check_integrity(NO_HELD)


def test_over_the_server_budget_the_least_recently_used_pin_goes():
    cache, alloc, pins, clock = make(slots=2000, budget=500)
    prefixes = [seq(1000 * (i + 1), 200) for i in range(3)]
    for p in prefixes:
        cache_sequence(cache, alloc, p)
    a = pins.pin(prefixes[0], None, "a", 300)
    clock.now += 1
    pins.pin(prefixes[1], None, "b", 300)
    clock.now += 1
    pins.pin(prefixes[0], None, "a", 300)  # used again: now the most recent
    clock.now += 1
    pins.pin(prefixes[2], None, "c", 300)  # 600 > 500: the least recent (b's) goes
    assert {p.tenant for p in pins.pins()} == {"a", "c"}
    assert pins.stats.pinned_tokens == 400 and pins.stats.demoted == 1
    assert a in pins.pins()
    cache.check_integrity(NO_HELD)


def test_a_pin_longer_than_the_budget_is_refused_and_others_stay():
    cache, alloc, pins, _ = make(slots=2000, budget=300)
    cache_sequence(cache, alloc, seq(0, 200))
    cache_sequence(cache, alloc, seq(5000, 400))
    assert pins.pin(seq(0, 200), None, "a", 300) is not None
    assert pins.pin(seq(5000, 400), None, "a", 300) is None
    assert pins.stats.refused_budget == 1 and pins.stats.pins == 1
    cache.check_integrity(NO_HELD)


def test_a_tenant_over_its_budget_puts_out_its_own_pins_only():
    cache, alloc, pins, clock = make(slots=4000, budget=1000, tenant_budget=300)
    for start in (0, 1000, 2000, 3000):
        cache_sequence(cache, alloc, seq(start, 200))
    pins.pin(seq(0, 200), None, "a", 300)
    clock.now += 1
    pins.pin(seq(1000, 200), None, "b", 300)
    clock.now += 1
    pins.pin(seq(2000, 200), None, "b", 300)  # b: 400 > 300, b's older pin goes
    assert sorted((p.tenant, p.tokens) for p in pins.pins()) == [("a", 200), ("b", 200)]
    assert pins.stats.tenant_tokens == {"a": 200, "b": 200}
    assert pins.pin(seq(3000, 200), None, "a", 300) is not None  # a's turn: b keeps its pin
    assert [p.tenant for p in pins.pins()].count("b") == 1
    cache.check_integrity(NO_HELD)


def test_pins_expire_on_the_clock_and_a_hit_refreshes_them():
    cache, alloc, pins, clock = make(slots=1000, budget=500)
    cache_sequence(cache, alloc, seq(0, 100))
    cache_sequence(cache, alloc, seq(500, 100))
    pins.pin(seq(0, 100), None, "a", 300)
    pins.pin(seq(500, 100), None, "a", 60)
    clock.now += 59
    assert pins.expire() == 0
    cache.match_prefix(seq(500, 100) + [7])  # a request admitted through it: refreshed
    clock.now += 59
    assert pins.expire() == 0
    clock.now += 2
    assert pins.expire() == 1 and pins.stats.expired == 1
    clock.now += 300
    assert pins.expire() == 1 and pins.stats.pins == 0
    assert cache.protected_size() == 0 and cache.evictable_size() == 200
    cache.check_integrity(NO_HELD)


def test_a_demoted_pin_goes_to_the_host_tier_not_away():
    cache, alloc, pins, _ = make(slots=1000, budget=300, host=2000)
    old, new = seq(0, 200), seq(5000, 200)
    cache_sequence(cache, alloc, old)
    cache_sequence(cache, alloc, new)
    pins.pin(old, None, "a", 300)
    pins.pin(new, None, "a", 300)  # 400 > 300: the old pin is demoted
    assert pins.stats.demoted == 1 and pins.stats.demoted_to_host == 1
    for i in range(20):  # device pressure: the demoted prefix leaves the device
        cache_sequence(cache, alloc, seq(20_000 + 1000 * i, 100))
    match = cache.match_prefix(old, record_stats=False)
    assert match.device_len == 0 and match.host_len == 200
    assert cached_len(cache, new) == 200
    cache.check_integrity(NO_HELD)


def test_pin_needs_a_cached_prefix_and_a_valid_ttl():
    cache, alloc, pins, _ = make(slots=1000, budget=500)
    assert pins.pin(seq(0, 50), None, "a", 300) is None
    assert pins.stats.not_cached == 1
    with pytest.raises(ValueError, match="ttl"):
        pins.pin(seq(0, 50), None, "a", 0)


def test_splits_below_a_pin_keep_its_counts_and_unpin_by_prefix():
    cache, alloc, pins, _ = make(slots=1000, budget=500)
    cache_sequence(cache, alloc, seq(0, 200))
    pins.pin(seq(0, 200), None, "a", 300)
    cache_sequence(cache, alloc, seq(0, 80) + seq(900, 50))  # splits the pinned edge at 80
    pins.pin(seq(0, 80), None, "b", 300)
    assert pins.stats.pinned_tokens == 200
    assert pins.stats.tenant_tokens == {"a": 200, "b": 80}
    cache.check_integrity(NO_HELD)
    assert pins.unpin(seq(0, 200), None) == 1
    assert pins.stats.pinned_tokens == 80
    assert pins.unpin() == 1 and cache.protected_size() == 0
    cache.check_integrity(NO_HELD)


def test_pins_of_namespaces_are_apart():
    cache, alloc, pins, _ = make(slots=1000, budget=500)
    cache_sequence(cache, alloc, seq(0, 100), "ns-x")
    assert pins.pin(seq(0, 100), None, "a", 300) is None  # not cached in the shared space
    assert pins.pin(seq(0, 100), "ns-x", "a", 300) is not None
    cache.check_integrity(NO_HELD)
