"""Stateful property test: a radix tree over a pool whose window layers are kept apart.

Random inserts, matches, locks, tombstoning (``evict_windows``) and whole-node eviction run
against a reference of what is cached in the global layers: a dict from every cached
(namespace, page-aligned prefix) to the slots of its last page. After every step
``check_integrity`` passes (window pages each in one place, flags and counters right), and:

- a match is the longest page boundary of the globally cached prefix whose last ``W - 1``
  tokens all still have their window KV (never longer: a local layer would read freed KV;
  never shorter: reuse would be lost), with the reference's slots;
- a locked match keeps the window KV before its end whatever is evicted or tombstoned;
- after inserting a freshly computed sequence, all of it matches again (tombstones in it are
  revived with the KV just computed);
- tombstoning frees what it is asked for, as far as unlocked window KV allows.

The machines run without and with a turn-end token (paths cut after it, the window before it
kept longer): the rules above hold either way.
"""

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache import RadixCache
from radixserve.cache.window_pages import WindowedAllocator
from testing.cache import reference_add, reference_match

NO_HELD = torch.empty(0, dtype=torch.int64)
NAMESPACES = [None, "tenant-b"]


def make_machine(page_size: int, capacity: int, window_slots: int, window: int, max_pages: int,
                 turn_end_ids: tuple[int, ...] = ()):  # fmt: skip
    class WindowMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.alloc = WindowedAllocator(capacity, page_size, window_slots, window)
            self.cache = RadixCache(self.alloc)
            self.cache.set_turn_end_ids(turn_end_ids)
            self.ref: dict[tuple, torch.Tensor] = {}
            self.locks: list[tuple] = []  # (handle, slots of the window before its end)

        def ref_match(self, ns, tokens):
            return reference_match(self.ref, page_size, ns, tokens)

        def expected_usable(self, slots: torch.Tensor) -> int:
            """The longest page boundary whose window before it has all its window pages."""
            for u in range(len(slots), 0, -page_size):
                if bool(self.alloc.has_windows(self.window_before(slots[:u])).all()):
                    return u
            return 0

        def window_before(self, slots: torch.Tensor) -> torch.Tensor:
            """The slots a local layer reads before resuming after ``slots`` (whole pages)."""
            start = max(0, len(slots) - window + 1) // page_size * page_size
            return slots[start:]

        sequences = st.lists(st.integers(0, 1), min_size=0, max_size=max_pages * page_size)

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def match(self, tokens, ns):
            n, slots = self.ref_match(ns, tokens)
            expected = self.expected_usable(slots)
            m = self.cache.match_prefix(tokens, ns)
            assert m.device_len == expected
            assert torch.equal(m.device_indices, slots[:expected])
            assert self.cache.peek_prefix(tokens, ns).length == expected

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def insert(self, tokens, ns):
            m = self.cache.match_prefix(tokens, ns)
            self.cache.inc_lock_ref(m.handle)
            aligned = len(tokens) // page_size * page_size
            need = aligned - m.device_len
            new = self.alloc.alloc(need)
            if new is None:
                self.cache.evict(need - self.alloc.free_size())
                self.sync()
                self.make_window_room(need)
                new = self.alloc.alloc(need)
            if new is not None:
                slots = torch.cat([m.device_indices, new])
                expected, _ = self.ref_match(ns, tokens)
                already = self.cache.insert(tokens[:aligned], slots, ns)
                assert already == max(expected, m.device_len)
                self.alloc.free(slots[m.device_len : already])
                reference_add(self.ref, page_size, ns, tokens, slots, already, aligned)
                assert self.cache.match_prefix(tokens[:aligned], ns).device_len == aligned
            self.cache.dec_lock_ref(m.handle)
            self.sync()

        def make_window_room(self, need):
            evictable = self.cache.window_evictable_size()
            free = self.alloc.window_free_size()
            freed = self.cache.evict_windows(need - free)
            if need - free > 0:
                assert freed >= min(need - free, evictable)
            assert self.alloc.window_free_size() == free + freed

        @rule(tokens=sequences, ns=st.sampled_from(NAMESPACES))
        def lock(self, tokens, ns):
            m = self.cache.match_prefix(tokens, ns)
            self.cache.inc_lock_ref(m.handle)
            self.locks.append((m.handle, self.window_before(m.device_indices)))

        @precondition(lambda self: self.locks)
        @rule(data=st.data())
        def unlock(self, data):
            handle, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
            self.cache.dec_lock_ref(handle)

        @rule(num_tokens=st.integers(0, window_slots))
        def tombstone(self, num_tokens):
            self.make_window_room(num_tokens)

        @rule(num_tokens=st.integers(0, capacity))
        def evict(self, num_tokens):
            self.cache.evict(num_tokens)
            self.sync()

        def sync(self):
            kept = {}
            for (ns, prefix), slots in self.ref.items():
                node_slots = self.global_match(ns, list(prefix))
                if node_slots is not None:
                    assert torch.equal(node_slots, slots)
                    kept[(ns, prefix)] = slots
            self.ref = kept
            assert self.cache.total_size() == page_size * len(self.ref)

        def global_match(self, ns, prefix):
            """The slots of ``prefix``'s last page if the tree holds it (tombstone or not)."""
            node = self.cache._roots.get(ns)
            prefix = np.asarray(prefix, dtype=np.int32)
            pos = 0
            while node is not None and pos < len(prefix):
                child = node.children.get(self.cache._child_key(prefix[pos:]))
                if child is None or not np.array_equal(
                    child.key[: len(prefix) - pos], prefix[pos : pos + len(child.key)]
                ):
                    return None
                if pos + len(child.key) >= len(prefix):
                    end = len(prefix) - pos
                    return child.value[end - page_size : end]
                pos += len(child.key)
                node = child
            return None

        @invariant()
        def consistent(self):
            self.cache.check_integrity(held_indices=NO_HELD)
            for _, before in self.locks:  # a locked match keeps its window
                assert bool(self.alloc.has_windows(before).all())

    return WindowMachine


PAGE1 = dict(page_size=1, capacity=64, window_slots=24, window=4, max_pages=12)
PAGE16 = dict(page_size=16, capacity=256, window_slots=96, window=40, max_pages=6)
MACHINES = {
    "page1": make_machine(**PAGE1),
    "page16": make_machine(**PAGE16),
    "page1-turn-ends": make_machine(**PAGE1, turn_end_ids=(1,)),
    "page16-turn-ends": make_machine(**PAGE16, turn_end_ids=(1,)),
}


@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
def test_window_tree_state_machine(machine):
    machine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()


@pytest.mark.parametrize("turn_ends", [True, False])
def test_the_window_before_a_turn_end_outlives_the_rest_of_its_path(turn_ends):
    """A conversation goes on past its first message (a document ending with a turn-end
    token). When window KV is dropped, the window before that turn end is kept with the
    conversation's own resume point, so a second conversation over the same document
    resumes after it; a cache that does not know the token drops it (the document's end is
    in the middle of a path) and the second conversation starts from nothing."""
    end_token, window = 9, 4
    alloc = WindowedAllocator(64, 1, 24, window)
    cache = RadixCache(alloc)
    cache.set_turn_end_ids([end_token] if turn_ends else [])
    document = [*range(10, 20), end_token]
    first = document + list(range(20, 30))
    cache.insert(first, alloc.alloc(len(first)))
    flagged = [n for n, _ in cache.nodes() if n.turn_end]
    assert [n.depth for n in flagged] == ([len(document)] if turn_ends else [])
    # the parts no resume point needs: 8 + 7 tokens with the turn end, 18 without
    freed = cache.evict_windows(15)
    assert freed == (15 if turn_ends else 18)
    cache.check_integrity()
    second = cache.match_prefix(document + [50, 51])
    assert second.device_len == (len(document) if turn_ends else 0)
    assert cache.match_prefix(first).device_len == len(first)  # its own next turn
