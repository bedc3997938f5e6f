"""The tree's listener interface, as a feature built on it sees it.

A listener that mirrors the tree from its callbacks alone (which nodes are on the device,
which have a host copy) agrees with the tree after every step of random inserts, loads,
locks, evictions on both tiers, storage attaches and resets, beside the tier controller (a
listener itself). Listeners hear arrivals in ascending order and departures in descending
order, and one removed hears nothing more.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache import KVPool, KVShape, PagedAllocator, RadixCache, TreeListener
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.tier_controller import WRITE_POLICIES, TierController
from radixserve.cache.tree_check import walk

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
PAGE = 2


class Mirror(TreeListener):
    """What a feature can know of the tree from the callbacks: nodes on each tier."""

    order = 1

    def __init__(self):
        self.device: set = set()
        self.host: set = set()

    def on_cached(self, node):
        assert node not in self.device
        self.device.add(node)

    def on_loaded(self, node, window):
        assert node not in self.device and node in self.host
        self.device.add(node)

    def on_host(self, node):
        assert node in self.device and node not in self.host
        self.host.add(node)

    def on_host_added(self, node):
        self.host.add(node)

    def on_split(self, upper, lower, n):
        for tier in (self.device, self.host):
            if lower in tier:
                tier.add(upper)

    def on_left_device(self, node):
        self.device.remove(node)

    def on_host_removed(self, node):
        self.host.remove(node)


class MirroredTree(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.setup(WRITE_POLICIES[0])

    def setup(self, policy):
        self.alloc = PagedAllocator(24, PAGE)
        host = HostKVPool(KVPool(SHAPE, self.alloc.num_slots), 40, PAGE)
        self.cache = RadixCache(self.alloc)
        self.mirror = Mirror()
        self.cache.add_listener(self.mirror)
        self.tiers = TierController(self.cache, host, policy, load_back_min_tokens=PAGE)
        self.locks: list = []

    @rule(policy=st.sampled_from(WRITE_POLICIES))
    def switch_policy(self, policy):
        self.setup(policy)

    sequences = st.lists(st.integers(0, 2), min_size=0, max_size=12)

    @rule(tokens=sequences)
    def insert(self, tokens):
        match = self.tiers.load_back(self.cache.match_prefix(tokens))
        self.cache.inc_lock_ref(match.handle)
        aligned = len(tokens) // PAGE * PAGE
        need = aligned - match.device_len
        new = self.alloc.alloc(need)
        if new is None:
            self.cache.evict(need - self.alloc.free_size())
            new = self.alloc.alloc(need)
        if new is not None and aligned:
            slots = torch.cat([match.device_indices, new])
            self.cache.insert(tokens[:aligned], slots)
        self.cache.dec_lock_ref(match.handle)

    @rule(tokens=sequences)
    def attach_from_storage(self, tokens):
        start = self.cache.peek_prefix(tokens).length
        aligned = len(tokens) // PAGE * PAGE
        slots = self.tiers.host.alloc(aligned - start)
        if aligned > start and slots is not None:
            self.tiers.attach_host(tokens[:aligned], None, start, slots)

    @rule(tokens=sequences)
    def lock(self, tokens):
        match = self.tiers.load_back(self.cache.match_prefix(tokens, record_stats=False))
        self.cache.inc_lock_ref(match.handle)
        self.locks.append(match.handle)

    @precondition(lambda self: self.locks)
    @rule()
    def unlock(self):
        self.cache.dec_lock_ref(self.locks.pop())

    @rule(n=st.integers(0, 24))
    def evict(self, n):
        self.cache.evict(n)

    @rule(n=st.integers(0, 40))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @rule()
    def reset(self):
        self.cache.reset()

    @invariant()
    def mirror_agrees(self):
        nodes = [node for node, _ in walk(self.cache)]
        assert self.mirror.device == {n for n in nodes if n.value is not None}
        assert self.mirror.host == {n for n in nodes if n.host_value is not None}
        assert sum(len(n.key) for n in self.mirror.device) == self.cache.total_size()
        assert sum(len(n.key) for n in self.mirror.host) == self.cache.host_size()
        self.cache.check_integrity(torch.empty(0, dtype=torch.int64))


def test_a_listener_mirrors_the_tree_from_its_callbacks():
    MirroredTree.TestCase.settings = settings(
        max_examples=40, stateful_step_count=30, deadline=None
    )
    MirroredTree.TestCase().runTest()


class Recorder(TreeListener):
    def __init__(self, order: int, log: list):
        self.order, self.log = order, log

    def on_cached(self, node):
        self.log.append(("cached", self.order))

    def on_leave_device(self, node):
        self.log.append(("leave", self.order))


def test_listeners_hear_arrivals_in_order_and_departures_in_reverse():
    log: list = []
    cache = RadixCache(PagedAllocator(8, PAGE))
    late, early = Recorder(5, log), Recorder(-1, log)
    cache.add_listener(late)
    cache.add_listener(early)
    cache.insert([1, 2], cache.allocator.alloc(2))
    cache.evict(2)
    assert log == [("cached", -1), ("cached", 5), ("leave", 5), ("leave", -1)]
    cache.remove_listener(late)
    cache.insert([3, 4], cache.allocator.alloc(2))
    assert log[4:] == [("cached", -1)]
