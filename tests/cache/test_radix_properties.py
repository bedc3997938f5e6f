"""Stateful property test: random operations on RadixCache against a reference model.

The reference is a dict from every cached (namespace, page-aligned prefix) to the slot run of
its last page. The tree must agree with it after every step, and ``check_integrity`` must pass
with no slot held outside the tree and the allocator. Each run draws an eviction policy (with
or without a cache threshold): a locked prefix is never evicted, and a single-leaf eviction
takes a leaf of the smallest priority, recomputed from scratch over all evictable leaves (so a
stale heap key, e.g. a reuse rate that fell with no event on its node, would be caught).
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixserve.cache import EVICTION_POLICIES, PagedAllocator, RadixCache
from testing.cache import reference_add, reference_match

NO_HELD = torch.empty(0, dtype=torch.int64)
NAMESPACES = [None, "tenant-b"]


def make_machine(page_size: int, capacity: int, alphabet: int, max_pages: int):
    class CacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.alloc = PagedAllocator(capacity, page_size)
            self.cache = RadixCache(self.alloc)
            self.ref: dict[tuple, torch.Tensor] = {}  # (ns, prefix) -> slots of its last page
            self.locks: list[tuple] = []  # (node, ns, prefix)

        @initialize(
            policy=st.sampled_from(EVICTION_POLICIES),
            threshold=st.sampled_from([None, 0.1, 0.25, 0.5, 1.0]),
        )
        def choose_policy(self, policy, threshold):
            self.cache = RadixCache(self.alloc, policy, cache_threshold=threshold)

        def ref_match(self, ns, tokens):
            return reference_match(self.ref, page_size, ns, tokens)

        sequences = st.lists(
            st.integers(0, alphabet - 1), min_size=0, max_size=max_pages * page_size
        )

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def match(self, tokens, ns):
            m = self.cache.match_prefix(tokens, ns)
            n, slots = self.ref_match(ns, tokens)
            assert m.device_len == n
            assert torch.equal(m.device_indices, slots)

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def peek(self, tokens, ns):
            nodes = self.cache.summary().num_nodes
            assert self.cache.peek_prefix(tokens, ns).length == self.ref_match(ns, tokens)[0]
            assert self.cache.summary().num_nodes == nodes  # a peek never splits an edge

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def insert(self, tokens, ns):
            m = self.cache.match_prefix(tokens, ns)
            self.cache.inc_lock_ref(m.handle)
            aligned = len(tokens) // page_size * page_size
            need = aligned - m.device_len
            new = self.alloc.alloc(need)
            if new is None:
                self.evict_and_sync(need - self.alloc.free_size())
                new = self.alloc.alloc(need)
            if new is not None:
                slots = torch.cat([m.device_indices, new])
                expected, _ = self.ref_match(ns, tokens)
                already = self.cache.insert(tokens[:aligned], slots, ns)
                assert already == expected
                self.alloc.free(slots[m.device_len : already])
                reference_add(self.ref, page_size, ns, tokens, slots, already, aligned)
            self.cache.dec_lock_ref(m.handle)

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def lock(self, tokens, ns):
            m = self.cache.match_prefix(tokens, ns)
            self.cache.inc_lock_ref(m.handle)
            self.locks.append((m.handle, ns, tuple(tokens[: m.device_len])))

        @precondition(lambda self: self.locks)
        @rule(data=st.data())
        def unlock(self, data):
            i = data.draw(st.integers(0, len(self.locks) - 1))
            node, _, _ = self.locks.pop(i)
            self.cache.dec_lock_ref(node)

        @rule(num_tokens=st.integers(0, capacity))
        def evict(self, num_tokens):
            self.evict_and_sync(num_tokens)

        @precondition(lambda self: self.cache.evictable_size() > 0)
        @rule()
        def evict_one_leaf(self):
            cache = self.cache
            leaves = list(cache._evictable_leaves)
            prios = {leaf: cache._heap.priority(leaf) for leaf in leaves}
            locked = [(n, n.lock_ref) for n, _, _ in self.locks if n and n.parent]
            self.evict_and_sync(1)
            gone = [leaf for leaf in leaves if leaf.parent.children.get(
                cache._child_key(leaf.key)) is not leaf]  # fmt: skip
            assert len(gone) == 1
            assert prios[gone[0]] == min(prios.values())
            for node, lock_ref in locked:
                assert node.lock_ref == lock_ref > 0 and node not in gone

        @rule()
        def reset(self):
            self.cache.reset()
            self.sync_after_eviction()
            assert self.cache.evictable_size() == 0

        def evict_and_sync(self, num_tokens):
            evictable = self.cache.evictable_size()
            before = self.cache.total_size()
            freed = self.cache.evict(num_tokens)
            assert freed >= min(num_tokens, evictable)
            assert self.cache.total_size() == before - freed
            self.sync_after_eviction()

        def sync_after_eviction(self):
            # Eviction only removes (which entries is the policy's business): drop from the
            # reference what the tree no longer has, then check the tree gained nothing.
            kept = {}
            for (ns, prefix), slots in self.ref.items():
                if self.cache.match_prefix(list(prefix), ns, record_stats=False).device_len == len(
                    prefix
                ):
                    kept[(ns, prefix)] = slots
            self.ref = kept
            assert self.cache.total_size() == page_size * len(self.ref)

        @invariant()
        def consistent(self):
            self.cache.check_integrity(held_indices=NO_HELD)
            assert self.cache.total_size() == page_size * len(self.ref)
            for _, ns, prefix in self.locks:  # locked prefixes are never evicted
                assert (ns, prefix) in self.ref or not prefix

    return CacheMachine


CacheMachinePage1 = make_machine(page_size=1, capacity=64, alphabet=3, max_pages=12)
CacheMachinePage16 = make_machine(page_size=16, capacity=256, alphabet=2, max_pages=5)


@pytest.mark.parametrize(
    "machine", [CacheMachinePage1, CacheMachinePage16], ids=["page1", "page16"]
)
def test_radix_cache_state_machine(machine):
    machine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()
