"""The tiered radix tree (device pool + host pool) under a hypothesis state machine.

Random inserts, matches with load-back, locks, evictions at both tiers, pages attached from
"storage" (written straight into host pages), resets, under each write policy. After every
step: ``check_integrity`` (free + cached + held == capacity on both pools, tail invariant,
sizes, leaf sets), the tree holds exactly the reference's prefixes, and every KV value read
back from the device after a load is the one written for that token when it was computed.
Plus directed tests of what each write policy copies and which KV events each move emits.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache import KVEventQueue, KVPool, KVShape, PagedAllocator
from radixserve.cache.events import BlockRemoved, BlockStored
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tier_controller import WRITE_POLICIES, TierController
from radixserve.cache.tree_check import walk

SHAPE = KVShape(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
NO_HELD = torch.empty(0, dtype=torch.int64)
NAMESPACES = [None, "tenant-b"]


def token_value(ns, prefix: tuple) -> float:
    """The KV 'computed' for the last token of ``prefix``: any value unique enough."""
    return float(hash((ns, prefix)) % 1_000_003)


def make_cache(page_size: int, device_slots: int, host_slots: int, policy: str, events=None):
    """The tree over a device pool and the tier controller with a host pool below it."""
    alloc = PagedAllocator(device_slots, page_size)
    pool = KVPool(SHAPE, alloc.num_slots)
    host = HostKVPool(pool, host_slots, page_size)
    cache = RadixCache(alloc, event_queue=events, event_block_size=page_size)
    return cache, TierController(cache, host, policy), pool


def write_device(pool: KVPool, slots: torch.Tensor, values: list[float]) -> None:
    v = torch.tensor(values)
    for layer in range(SHAPE.num_layers):
        pool.k[layer, 0, slots, 0] = v + layer
        pool.v[layer, 0, slots, 0] = -(v + layer)


def read_device(pool: KVPool, slots: torch.Tensor) -> list[float]:
    for layer in range(SHAPE.num_layers):  # every layer, K and V, must agree
        k, v = pool.k[layer, 0, slots, 0], pool.v[layer, 0, slots, 0]
        assert torch.equal(k - layer, -v - layer), "K and V of a slot disagree"
        assert torch.equal(k - layer, pool.k[0, 0, slots, 0]), "layers of a slot disagree"
    return pool.k[0, 0, slots, 0].tolist()


def make_machine(page_size: int, device: int, host: int, alphabet: int, max_pages: int):
    class TieredMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.policy = WRITE_POLICIES[0]
            self.setup(self.policy)

        def setup(self, policy):
            self.cache, self.tiers, self.pool = make_cache(page_size, device, host, policy)
            self.alloc = self.cache.allocator
            self.ref: set[tuple] = set()  # (ns, page-aligned prefix) cached on some tier
            self.locks: list[tuple] = []

        @rule(policy=st.sampled_from(WRITE_POLICIES))
        def switch_policy(self, policy):
            self.setup(policy)

        def expected(self, ns, tokens, n):
            return [token_value(ns, tuple(tokens[: i + 1])) for i in range(n)]

        def ref_len(self, ns, tokens):
            n = 0
            while n + page_size <= len(tokens) and (ns, tuple(tokens[: n + page_size])) in self.ref:
                n += page_size
            return n

        sequences = st.lists(
            st.integers(0, alphabet - 1), min_size=0, max_size=max_pages * page_size
        )

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def insert(self, tokens, ns):
            match = self.tiers.load_back(self.cache.match_prefix(tokens, ns))
            assert match.total_len == self.ref_len(ns, tokens)
            self.cache.inc_lock_ref(match.handle)
            aligned = len(tokens) // page_size * page_size
            need = aligned - match.device_len
            new = self.alloc.alloc(need)
            if new is None:
                self.cache.evict(need - self.alloc.free_size())
                new = self.alloc.alloc(need)
            if new is not None:
                start = match.device_len
                write_device(self.pool, new, self.expected(ns, tokens, aligned)[start:])
                slots = torch.cat([match.device_indices, new])
                already = self.cache.insert(tokens[:aligned], slots, ns)
                assert already == start  # everything past the device part was taken
                for end in range(page_size, aligned + 1, page_size):
                    self.ref.add((ns, tuple(tokens[:end])))
            self.cache.dec_lock_ref(match.handle)
            self.sync()

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES), lock=st.booleans())
        def match_and_load(self, tokens, ns, lock):
            nodes = sum(1 for _ in walk(self.cache))
            peek = self.cache.peek_prefix(tokens, ns).length
            assert sum(1 for _ in walk(self.cache)) == nodes  # a peek splits nothing
            match = self.cache.match_prefix(tokens, ns)
            assert match.total_len == peek == self.ref_len(ns, tokens)
            loaded = self.tiers.load_back(match)  # all, or the leading part that fits
            assert match.device_len <= loaded.device_len <= match.total_len
            assert loaded.device_len + loaded.host_len == match.total_len
            got = read_device(self.pool, loaded.device_indices)
            assert got == self.expected(ns, tokens, loaded.device_len)
            if lock:
                self.cache.inc_lock_ref(loaded.handle)
                self.locks.append((loaded.handle, ns, tuple(tokens[: loaded.device_len])))
            self.sync()

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def attach_from_storage(self, tokens, ns):
            start = self.cache.peek_prefix(tokens, ns).length
            aligned = len(tokens) // page_size * page_size
            slots = self.tiers.host.alloc(aligned - start)
            if aligned == start or slots is None:
                return
            values = torch.tensor(self.expected(ns, tokens, aligned)[start:])
            host = self.tiers.host
            pages, offsets = slots // page_size, slots % page_size
            for layer in range(SHAPE.num_layers):  # straight into host pages, as a fetch does
                host.data[pages, layer, 0, 0, offsets, 0] = values + layer
                host.data[pages, layer, 1, 0, offsets, 0] = -(values + layer)
            added = self.tiers.attach_host(tokens[:aligned], ns, start, slots)
            assert added == aligned - start
            for end in range(start + page_size, aligned + 1, page_size):
                self.ref.add((ns, tuple(tokens[:end])))
            self.sync()

        @precondition(lambda self: self.locks)
        @rule(data=st.data())
        def unlock(self, data):
            node, _, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
            self.cache.dec_lock_ref(node)

        @rule(num_tokens=st.integers(0, device))
        def evict_device(self, num_tokens):
            evictable = self.cache.evictable_size()
            freed = self.cache.evict(num_tokens)
            assert freed >= min(num_tokens, evictable)
            self.sync()

        @rule(num_tokens=st.integers(0, host))
        def evict_host(self, num_tokens):
            self.cache.evict_host(num_tokens)
            self.sync()

        @rule()
        def reset(self):
            self.cache.reset()
            assert self.cache.evictable_size() == 0
            self.sync()

        def sync(self):
            # Evictions only remove (which entries is the policies' business): drop from the
            # reference what the tree no longer has anywhere.
            self.ref = {
                (ns, p)
                for ns, p in self.ref
                if self.cache.peek_prefix(list(p), ns).length == len(p)
            }

        @invariant()
        def consistent(self):
            self.cache.check_integrity(held_indices=NO_HELD)
            tree_tokens = sum(len(node.key) for node, _ in walk(self.cache))
            assert tree_tokens == page_size * len(self.ref)  # the tree gained nothing
            for _, ns, prefix in self.locks:  # locked prefixes stay on the device
                m = self.cache.match_prefix(list(prefix), ns, record_stats=False)
                assert m.device_len == len(prefix)

    return TieredMachine


TieredPage1 = make_machine(page_size=1, device=24, host=40, alphabet=3, max_pages=10)
TieredPage4 = make_machine(page_size=4, device=32, host=48, alphabet=2, max_pages=5)


@pytest.mark.parametrize("machine", [TieredPage1, TieredPage4], ids=["page1", "page4"])
def test_tiered_cache_state_machine(machine):
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
    machine.TestCase().runTest()


# ---------------------------------------------------------------------- directed tests
def cache_tokens(cache, tiers, pool, tokens, ns=None):
    match = tiers.load_back(cache.match_prefix(tokens, ns))
    cache.inc_lock_ref(match.handle)
    new = cache.allocator.alloc(len(tokens) - match.device_len)
    if new is None:
        cache.evict(len(tokens) - match.device_len - cache.allocator.free_size())
        new = cache.allocator.alloc(len(tokens) - match.device_len)
    write_device(pool, new, [token_value(ns, tuple(tokens[: i + 1]))
                             for i in range(match.device_len, len(tokens))])  # fmt: skip
    cache.insert(tokens, torch.cat([match.device_indices, new]), ns)
    cache.dec_lock_ref(match.handle)
    return match


@pytest.mark.parametrize(
    "policy, host_after_insert, host_after_reuse",
    [("write_through", 8, 8), ("write_through_selective", 0, 8), ("write_back", 0, 0)],
)
def test_write_policies_copy_when_they_say(policy, host_after_insert, host_after_reuse):
    cache, tiers, pool = make_cache(4, 16, 32, policy)
    a = list(range(8))
    cache_tokens(cache, tiers, pool, a)
    assert cache.host_size() == host_after_insert
    cache_tokens(cache, tiers, pool, a + [9, 9, 9, 9])  # reuses a (one hit)
    assert cache.host_size() >= host_after_reuse
    cache.evict(cache.evictable_size())  # leaves the device
    assert cache.host_size() == 12 if policy != "write_through_selective" else 8
    m = cache.match_prefix(a + [9, 9, 9, 9, 0])
    assert m.device_len == 0 and m.host_len == cache.host_size()
    cache.check_integrity(NO_HELD)


def test_load_back_is_skipped_below_the_threshold_and_counts_loads():
    cache, tiers, pool = make_cache(4, 16, 32, "write_through")
    tiers.load_back_min_tokens = 12
    cache_tokens(cache, tiers, pool, list(range(8)))
    cache.evict(16)
    m = cache.match_prefix(list(range(8)) + [1])
    assert m.host_len == 8 and tiers.load_back(m) is m  # 8 < 12 tokens: computed instead
    tiers.load_back_min_tokens = 8
    loaded = tiers.load_back(m)
    assert loaded.device_len == 8 and loaded.host_len == 0
    assert read_device(pool, loaded.device_indices) == [token_value(None, tuple(range(i + 1)))
                                                        for i in range(8)]  # fmt: skip
    stats = tiers.stats()
    assert stats.loads == 1 and stats.pages_to_device == 2 and stats.load_latency.count == 1
    cache.check_integrity(NO_HELD)


def test_tier_moves_emit_events_with_their_medium():
    events = KVEventQueue()
    cache, tiers, pool = make_cache(4, 16, 32, "write_through", events)
    cache_tokens(cache, tiers, pool, list(range(8)))
    first = events.drain()
    stored = [(type(e).__name__, e.medium) for e in first]
    assert stored == [("BlockStored", "device"), ("BlockStored", "host")]
    same_blocks = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in first]
    assert same_blocks[0] == same_blocks[1] and len(same_blocks[0][0]) == 2  # moved, not renamed
    cache.evict(16)  # off the device, kept on the host
    assert [(type(e).__name__, e.medium) for e in events.drain()] == [("BlockRemoved", "device")]
    tiers.load_back(cache.match_prefix(list(range(8)) + [0]))
    back = events.drain()
    assert [(type(e).__name__, e.medium) for e in back] == [("BlockStored", "device")]
    assert (back[0].block_hashes, back[0].parent_block_hash, back[0].token_ids) == same_blocks[0]
    cache.reset()
    drained = events.drain()
    assert [(type(e).__name__, getattr(e, "medium", None)) for e in drained] == [
        ("BlockRemoved", "device"), ("BlockRemoved", "host"), ("AllBlocksCleared", None)
    ]  # fmt: skip
    assert all(isinstance(e, BlockStored | BlockRemoved) for e in drained[:2])


def test_a_device_leaf_with_host_children_is_copied_before_it_leaves():
    cache, tiers, pool = make_cache(4, 16, 32, "write_through_selective")
    a = list(range(4))
    cache_tokens(cache, tiers, pool, a)
    cache_tokens(cache, tiers, pool, a + [7] * 4)
    m = cache.match_prefix(a + [7] * 4 + [0])  # a hit: [7]*4 and its parent get host copies
    cache.record_hit(m.handle, 9, 8)
    cache.check_integrity(NO_HELD)
    node = m.handle
    # Drop the parent's copy by hand to force the case, then evict: the parent must be copied
    # again rather than orphan its host-only child.
    tiers.host.free(node.parent.host_value)
    cache._host_size -= len(node.parent.key)
    node.parent.host_value = None
    cache.evict(16)
    assert cache.match_prefix(a + [7] * 4 + [0]).host_len == 8
    cache.check_integrity(NO_HELD)


def test_a_lookup_ending_on_the_host_reorders_the_device_leaf_above_it():
    # A device leaf whose only child is host-only is reached by a lookup that ends on the host
    # (here: a storage fetch hanging more pages below): its recency changes, so its place in
    # the eviction order must too, or eviction skips it as stale.
    cache, tiers, pool = make_cache(1, 24, 40, "write_back")

    def attach(tokens):
        start = cache.peek_prefix(tokens).length
        assert tiers.attach_host(tokens, None, start, tiers.host.alloc(len(tokens) - start))

    attach([0, 0])
    loaded = tiers.load_back(cache.match_prefix([0]))  # [0] on the device, [0, 0] on the host
    assert loaded.device_len == 1
    attach([0, 0, 0])
    cache.check_integrity(NO_HELD)
    assert cache.evict(1) == 1  # the device leaf is found and evicted
    cache.check_integrity(NO_HELD)


def test_a_full_device_pool_loads_back_the_leading_part_that_fits():
    cache, tiers, pool = make_cache(4, 16, 48, "write_through")
    a, b = list(range(12)), [7] * 12
    cache_tokens(cache, tiers, pool, a)
    cache.evict(16)  # a: host only
    held = cache_tokens(cache, tiers, pool, b)  # b takes 12 of the 16 device slots ...
    locked = cache.match_prefix(b + [0], record_stats=False)
    cache.inc_lock_ref(locked.handle)  # ... and a running request holds it
    m = cache.match_prefix(a + [0])
    assert held.device_len == 0 and m.device_len == 0 and m.host_len == 12
    part = tiers.load_back(m)
    assert (part.device_len, part.host_len) == (4, 8)  # the room left: one page
    assert read_device(pool, part.device_indices) == [token_value(None, tuple(a[: i + 1]))
                                                      for i in range(4)]  # fmt: skip
    assert tiers.stats().partial_loads == 1
    cache.check_integrity(NO_HELD)
    cache.dec_lock_ref(locked.handle)
    rest = tiers.load_back(cache.match_prefix(a + [0]))  # room again: the rest comes back
    assert (rest.device_len, rest.host_len) == (12, 0)
    assert read_device(pool, rest.device_indices) == [token_value(None, tuple(a[: i + 1]))
                                                      for i in range(12)]  # fmt: skip
    cache.check_integrity(NO_HELD)


def test_a_load_smaller_than_the_minimum_is_not_made_partially():
    cache, tiers, pool = make_cache(4, 16, 48, "write_through")
    tiers.load_back_min_tokens = 8
    a = list(range(12))
    cache_tokens(cache, tiers, pool, a)
    cache.evict(16)
    cache_tokens(cache, tiers, pool, [7] * 12)
    locked = cache.match_prefix([7] * 12 + [0], record_stats=False)
    cache.inc_lock_ref(locked.handle)
    m = cache.match_prefix(a + [0])
    assert tiers.load_back(m) is m  # 4 tokens would fit, fewer than 8: computed instead
    assert tiers.stats().load_failures == 1
    cache.check_integrity(NO_HELD)


def test_a_load_keeps_its_host_nodes_while_making_room_evicts_host_leaves():
    cache, tiers, pool = make_cache(4, 12, 12, "write_back")
    a, b = list(range(8)), [9] * 8
    cache_tokens(cache, tiers, pool, a)
    cache_tokens(cache, tiers, pool, b)  # a leaves the device: copied to the host (8 of 12)
    slots = tiers.host.alloc(4)
    assert tiers.attach_host(a + [5] * 4, None, 8, slots) == 4  # a child of a: host full
    m = cache.match_prefix(a + [0])
    assert (m.device_len, m.host_len) == (0, 8)
    # Room for a means evicting b, whose copy to the full host evicts a's child; a itself,
    # then a host leaf, must not go too.
    loaded = tiers.load_back(m)
    assert loaded.device_len == 8
    assert read_device(pool, loaded.device_indices) == [token_value(None, tuple(a[: i + 1]))
                                                        for i in range(8)]  # fmt: skip
    cache.check_integrity(NO_HELD)


def test_storage_blocks_are_copied_on_an_io_thread_without_compute_threads():
    """A storage I/O thread reads and writes host blocks without a torch kernel: one there
    would start a second OpenMP team (new OS threads) whose workers the forward pass then has
    to wake at every operation. The block round-trips exactly."""
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.float32)
    host = HostKVPool(KVPool(shape, 256), 1024, 16)
    host.data.copy_(torch.arange(host.data.numel(), dtype=torch.float32).view_as(host.data))
    batch = host.pages(list(range(8)), per_block=4)  # two blocks of four 16-token pages
    counts = []

    def io() -> None:
        before = len(os.listdir("/proc/self/task"))
        batch.write_page(1, bytes(batch.read_page(0)))  # block 0's KV into block 1's pages
        counts.append((before, len(os.listdir("/proc/self/task"))))

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        t = threading.Thread(target=io)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(threads)
    assert counts[0][1] == counts[0][0]  # no thread was started on its behalf
    assert torch.equal(host.data[4:8], host.data[0:4])
    assert not torch.equal(host.data[0:4], host.data[8:12])  # (the values differ by page)


def test_pages_from_storage_hang_with_or_without_window_kv():
    """A fetch's blocks with and without window KV hang as host nodes saying which; a match
    never resumes where the window before it comes from one without; a host copy without
    window KV is replaced by a fetched one with it."""
    from radixserve.cache.window_pages import WindowedAllocator

    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    window_layers=(0,))  # fmt: skip
    alloc = WindowedAllocator(64, 4, window_slots=32, window=5)  # a window reads 4 back
    pool = KVPool(shape, alloc.num_slots, window_map=alloc.window_map,
                  window_slots=alloc.window_slots)  # fmt: skip
    cache = RadixCache(alloc)
    tiers = TierController(cache, HostKVPool(pool, 128, 4), "write_back")
    tokens = list(range(100, 124))  # blocks of 8: with, without, with window KV
    window = np.repeat([True, False, True], 8)
    host = tiers.host
    assert tiers.attach_host(tokens, None, 0, host.alloc(24), window) == 24
    cache.check_integrity(NO_HELD)
    flags = [(len(n.key), n.host_window) for n, _ in cache.nodes()]
    assert flags == [(8, True), (8, False), (8, True)]
    # the window before 24 ([20, 24)) has its KV, the one before 16 ([12, 16)) has not
    assert cache.match_prefix(tokens).total_len == 24
    assert cache.match_prefix(tokens[:16]).total_len == 8
    # the middle block again, with window KV: the copy without it is replaced, nothing added
    before = host.allocator.free_size()
    assert tiers.attach_host(tokens[:16], None, 8, host.alloc(8), np.ones(8, bool)) == 0
    assert [n.host_window for n, _ in cache.nodes()] == [True, True, True]
    assert host.allocator.free_size() == before
    assert cache.match_prefix(tokens[:16]).total_len == 16
    cache.check_integrity(NO_HELD)


def test_a_load_longer_than_the_window_room_brings_the_rest_as_tombstones():
    """A host path of 48 tokens with every layer's KV, a window pool of 32 slots: the load
    brings all 48 tokens, the last 32 with their window KV and the 16 before as tombstones
    (their window layers are not written anywhere, the pool's pad slot stays zero), so the
    request resumes at the end; without this the window pool bounded the load to 32."""
    from radixserve.cache.window_pages import WindowedAllocator

    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    window_layers=(0,))  # fmt: skip
    alloc = WindowedAllocator(64, 4, window_slots=32, window=5)
    pool = KVPool(shape, alloc.num_slots, window_map=alloc.window_map,
                  window_slots=alloc.window_slots)  # fmt: skip
    cache = RadixCache(alloc)
    tiers = TierController(cache, HostKVPool(pool, 128, 4), "write_back", load_back_min_tokens=4)
    host = tiers.host
    tokens = list(range(100, 148))
    slots = host.alloc(48)
    values = torch.arange(1, 49, dtype=torch.float32)
    host.data[host.pages_of(slots)] = values.view(12, 1, 1, 1, 4, 1).expand(-1, 2, 2, 1, 4, 2)
    assert tiers.attach_host(tokens, None, 0, slots, np.ones(48, bool)) == 48
    match = cache.match_prefix(tokens)
    assert (match.device_len, match.host_len) == (0, 48)
    loaded = tiers.load_back(match)
    assert loaded.device_len == 48
    cache.check_integrity(NO_HELD)
    device = loaded.device_indices
    assert torch.equal(pool.k[0, 0, device, 0], values)  # the global layer: every token
    has = alloc.has_windows(device)
    assert has.tolist() == [False] * 4 + [True] * 8  # pages: 16 tombstoned, 32 with windows
    tail = pool.to_window(device[16:])
    assert torch.equal(pool.wk[0, 0, tail, 0], values[16:])
    assert not pool.wk[0, 0, alloc.window_pad].any() and not pool.wv[0, 0, alloc.window_pad].any()
    assert cache.match_prefix(tokens).device_len == 48  # resumes at the end
    assert cache.match_prefix(tokens[:12]).device_len == 0  # not inside the tombstones
    cache.check_integrity(NO_HELD)
