"""Drafts from the cache: the n-gram index over the radix tree (``drafts/cache_index.py``).

The index agrees with the tree after every step of random inserts in several namespaces,
loads back from the host, locks, evictions on both tiers and resets: every entry names a
device node of its namespace whose path holds that n-gram (the tree's integrity check runs
the index's), at most one entry per device token and size, and what was just cached is found.
A lookup only ever proposes what follows its n-gram in the request's own namespace.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from radixserve.cache import PagedAllocator, RadixCache
from radixserve.cache.tree_check import walk
from radixserve.engine.drafts.cache_index import NgramIndex, path_tail
from testing.tree_machine import tiered_tree_machine

SIZES = (4, 2)


def paths(cache: RadixCache, namespace) -> list[np.ndarray]:
    """Every root-to-node token sequence of ``namespace`` on the device."""
    return [
        path_tail(node, len(node.key), node.depth)
        for node, _ in walk(cache)
        if node.namespace == namespace and node.value is not None
    ]


def follows(cache: RadixCache, namespace, ids: list[int], tokens: list[int]) -> bool:
    """Whether some path of ``namespace`` holds ``ids``' last 2 tokens followed by ``tokens``."""
    want = [*ids[-2:], *tokens]
    for p in paths(cache, namespace):
        p = p.tolist()
        if any(p[i : i + len(want)] == want for i in range(len(p) - len(want) + 1)):
            return True
    return False


SEQUENCES = st.lists(st.integers(0, 3), min_size=0, max_size=14)
NAMESPACES = st.sampled_from([None, "a", "b"])


class IndexedTree(tiered_tree_machine(slots=40, sequences=SEQUENCES, namespaces=NAMESPACES)):
    def make_listener(self) -> NgramIndex:
        return NgramIndex(SIZES)

    @rule(ids=SEQUENCES, namespace=NAMESPACES)
    def propose(self, ids, namespace):
        """A lookup proposes a real continuation of its n-gram, from its own namespace."""
        ids = np.array(ids, np.int32)
        found = self.listener.find(ids, namespace)
        if found is None:
            return
        node, end, match = found
        assert node.namespace == namespace and match >= min(SIZES)
        tokens = self.listener.continuation(node, end, 6)
        assert tokens and follows(self.cache, namespace, ids.tolist(), tokens)

    @invariant()
    def index_agrees(self):
        self.cache.check_integrity(torch.empty(0, dtype=torch.int64))  # runs index.check
        assert self.listener.num_entries <= self.cache.total_size() * len(SIZES)
        if self.cache.total_size() == 0:
            assert self.listener.num_entries == 0
        if self.last is not None:  # what was just cached is found (when something follows)
            tokens, namespace = self.last
            for cut in range(min(SIZES), len(tokens)):
                assert self.listener.find(np.array(tokens[:cut], np.int32), namespace) is not None


def test_the_index_stays_in_step_with_the_tree():
    IndexedTree.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
    IndexedTree.TestCase().runTest()


def test_a_tenant_is_never_proposed_another_tenant_s_text():
    cache = RadixCache(PagedAllocator(64, 1))
    index = NgramIndex()
    cache.add_listener(index)
    secret = list(range(100, 130))
    cache.insert(secret, cache.allocator.alloc(len(secret)), "a")
    assert index.find(np.array(secret[:10], np.int32), "b") is None
    assert index.find(np.array(secret[:10], np.int32), None) is None
    node, end, match = index.find(np.array(secret[:10], np.int32), "a")
    assert index.continuation(node, end, 5) == secret[10:15] and match == 10
    cache.evict(len(secret))
    assert index.num_entries == 0 and index.find(np.array(secret[:10], np.int32), "a") is None


def test_a_new_leaf_does_not_hide_an_earlier_occurrence_that_has_a_continuation():
    cache = RadixCache(PagedAllocator(16, 1))
    index = NgramIndex(SIZES)
    cache.add_listener(index)
    cache.insert([2, 0], cache.allocator.alloc(2))
    cache.insert([2, 0, 2, 0], torch.cat([cache.match_prefix([2, 0]).device_indices,
                                          cache.allocator.alloc(2)]))  # fmt: skip
    node, end, _ = index.find(np.array([2, 0], np.int32), None)
    assert index.continuation(node, end, 4) == [2, 0]
