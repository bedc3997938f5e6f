"""A hypothesis state machine of a radix tree on two tiers, for tests of what listens to it.

``tiered_tree_machine`` builds the base class: a paged device pool, a host pool and a tier
controller around one ``RadixCache``, with the listener under test (``make_listener``)
added before the controller, and the rules every such test shares: insert what a
finishing request caches (loading back from the host first), lock and unlock prefixes as
running requests do, evict on either tier, reset. A subclass adds its own rules and the
invariant that the listener agrees with the tree.

``self.last`` is the most recent insert, ``(tokens, namespace)``, while all of it is still
on the device (``None`` once an eviction or a reset took part of it).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from radixserve.cache import KVPool, KVShape, PagedAllocator, RadixCache, TreeListener
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.tier_controller import WRITE_POLICIES, TierController

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
PAGE = 2
HOST_SLOTS = 40
ONE_NAMESPACE = st.just(None)


def tiered_tree_machine(
    *, slots: int, sequences: st.SearchStrategy, namespaces: st.SearchStrategy = ONE_NAMESPACE
) -> type[RuleBasedStateMachine]:
    """The base class for a tree of ``slots`` device slots, fed token lists from
    ``sequences`` in namespaces from ``namespaces``."""

    class TieredTree(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.build(WRITE_POLICIES[0])

        def make_listener(self) -> TreeListener:
            raise NotImplementedError

        def build(self, policy: str) -> None:
            """A fresh tree whose tier controller writes to the host by ``policy``."""
            self.alloc = PagedAllocator(slots, PAGE)
            host = HostKVPool(KVPool(SHAPE, self.alloc.num_slots), HOST_SLOTS, PAGE)
            self.cache = RadixCache(self.alloc)
            self.listener = self.make_listener()
            self.cache.add_listener(self.listener)
            self.tiers = TierController(self.cache, host, policy, load_back_min_tokens=PAGE)
            self.locks: list = []
            self.last: tuple | None = None

        @rule(tokens=sequences, namespace=namespaces)
        def insert(self, tokens, namespace):
            match = self.tiers.load_back(self.cache.match_prefix(tokens, namespace))
            self.cache.inc_lock_ref(match.handle)
            aligned = len(tokens) // PAGE * PAGE
            need = aligned - match.device_len
            new = self.alloc.alloc(need)
            if new is None:
                self.cache.evict(need - self.alloc.free_size())
                new = self.alloc.alloc(need)
            if new is not None and aligned:
                slots = torch.cat([match.device_indices, new])
                self.cache.insert(tokens[:aligned], slots, namespace)
                self.last = (tokens[:aligned], namespace)
            self.cache.dec_lock_ref(match.handle)

        @rule(tokens=sequences, namespace=namespaces)
        def lock(self, tokens, namespace):
            match = self.cache.match_prefix(tokens, namespace, record_stats=False)
            match = self.tiers.load_back(match)
            self.cache.inc_lock_ref(match.handle)
            self.locks.append(match.handle)

        @precondition(lambda self: self.locks)
        @rule()
        def unlock(self):
            self.cache.dec_lock_ref(self.locks.pop())

        @rule(n=st.integers(0, slots))
        def evict(self, n):
            self.cache.evict(n)
            if self.last:  # peek_prefix counts the host tier too: ask for the device's part
                on_device = self.cache.match_prefix(*self.last, record_stats=False).device_len
                if on_device < len(self.last[0]):
                    self.last = None

        @rule(n=st.integers(0, HOST_SLOTS))
        def evict_host(self, n):
            self.cache.evict_host(n)

        @rule()
        def reset(self):
            self.cache.reset()
            self.last = None

    return TieredTree
