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
from hypothesis.stateful import invariant, rule

from radixserve.cache import PagedAllocator, RadixCache, TreeListener
from radixserve.cache.tier_controller import WRITE_POLICIES
from radixserve.cache.tree_check import walk
from testing.tree_machine import PAGE, tiered_tree_machine


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


SEQUENCES = st.lists(st.integers(0, 2), min_size=0, max_size=12)


class MirroredTree(tiered_tree_machine(slots=24, sequences=SEQUENCES)):
    def make_listener(self) -> Mirror:
        return Mirror()

    @rule(policy=st.sampled_from(WRITE_POLICIES))
    def switch_policy(self, policy):
        self.build(policy)

    @rule(tokens=SEQUENCES)
    def attach_from_storage(self, tokens):
        start = self.cache.peek_prefix(tokens).length
        aligned = len(tokens) // PAGE * PAGE
        slots = self.tiers.host.alloc(aligned - start)
        if aligned > start and slots is not None:
            self.tiers.attach_host(tokens[:aligned], None, start, slots)

    @invariant()
    def mirror_agrees(self):
        nodes = [node for node, _ in walk(self.cache)]
        mirror = self.listener
        assert mirror.device == {n for n in nodes if n.value is not None}
        assert mirror.host == {n for n in nodes if n.host_value is not None}
        assert sum(len(n.key) for n in mirror.device) == self.cache.total_size()
        assert sum(len(n.key) for n in mirror.host) == self.cache.host_size()
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
