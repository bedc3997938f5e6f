"""The radix tree's KV events: a subscriber that applies them holds exactly the blocks of
every cached prefix, through inserts, splits, evictions, flushes and events switched off and
on again; the hashes are the pure module's, so a router computes the same names."""

import numpy as np
import pytest
import torch

from radixserve.cache import KVEventQueue, PagedAllocator, RadixCache
from radixserve.cache.tree_check import walk
from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.kvevents.types import AllBlocksCleared, BlockRemoved, BlockStored
from testing.cache import cache_sequence

NO_HELD = torch.empty(0, dtype=torch.int64)


class Mirror:
    """What a subscriber knows: hash -> (parent hash, block tokens)."""

    def __init__(self):
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    tokens = tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                    assert len(tokens) == e.block_size
                    assert h not in self.blocks, "a block stored twice"
                    assert parent is None or parent in self.blocks, "stored before its parent"
                    self.blocks[h] = (parent, tokens)
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.blocks, "removed a block never stored"
                    del self.blocks[h]
            else:
                assert isinstance(e, AllBlocksCleared)
                self.blocks.clear()


def expected_blocks(cache: RadixCache) -> set[int]:
    """Every whole block of every cached prefix, hashed from scratch by the pure module."""
    out: set[int] = set()
    for node, _ in walk(cache):
        path, n = [], node
        while n.parent is not None:
            path.append(n.key)
            n = n.parent
        tokens = np.concatenate(path[::-1])
        out.update(prompt_block_hashes(tokens, cache.event_block_size, node.namespace))
    return out


@pytest.mark.parametrize("page_size,block_size", [(1, 4), (1, 16), (2, 2), (2, 6), (4, 8)])
def test_events_rebuild_exactly_the_cached_blocks(page_size, block_size):
    rng = np.random.default_rng(page_size * 100 + block_size)
    alloc = PagedAllocator(384, page_size)
    queue = KVEventQueue()
    cache = RadixCache(alloc, "lru", queue, event_block_size=block_size)
    mirror = Mirror()
    systems = [rng.integers(0, 20, int(rng.integers(5, 40))).tolist() for _ in range(3)]
    on = True
    for step in range(400):
        op = rng.random()
        if op < 0.6:  # insert, often behind a shared prefix (splits)
            head = systems[int(rng.integers(3))] if rng.random() < 0.7 else []
            seq = head + rng.integers(0, 20, int(rng.integers(1, 60))).tolist()
            ns = None if rng.random() < 0.8 else "tenant-a"
            cache_sequence(cache, alloc, seq, namespace=ns)
        elif op < 0.8:  # a match splits an edge without changing what is cached
            seq = systems[int(rng.integers(3))][: int(rng.integers(1, 30))]
            cache.match_prefix(seq, record_stats=False)
        elif op < 0.95:
            cache.evict(int(rng.integers(1, 100)))
        elif op < 0.97:
            cache.reset()
        elif on:  # the last subscriber left: no hashing until one comes back
            cache.disable_events()
            mirror = Mirror()
            on = False
        if not on and rng.random() < 0.1:
            cache.enable_events(queue)  # a snapshot of the whole tree comes first
            on = True
        if on:
            mirror.apply(queue.drain())
            assert set(mirror.blocks) == expected_blocks(cache), f"step {step}"
            cache.check_integrity(held_indices=NO_HELD)
    assert cache.stats.evicted_tokens > 0


def test_a_straddling_block_names_its_tokens_from_the_sequence_start():
    alloc = PagedAllocator(64, 1)
    queue = KVEventQueue()
    cache = RadixCache(alloc, "lru", queue, event_block_size=4)
    cache_sequence(cache, alloc, [1, 2, 3, 4, 5, 6])  # one block [1..4], 2 tokens left over
    cache_sequence(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # leaf [7, 8, 9] ends block 2
    first, second = queue.drain()
    assert first.token_ids == [1, 2, 3, 4] and second.token_ids == [5, 6, 7, 8]
    assert second.parent_block_hash == first.block_hashes[0]
    assert second.block_hashes == prompt_block_hashes(range(1, 10), 4)[1:]
    cache.evict(3)  # the leaf [7, 8, 9] goes, and with it block [5..8]
    (removed,) = queue.drain()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == second.block_hashes


def test_no_hashing_while_events_are_off():
    alloc = PagedAllocator(64, 1)
    cache = RadixCache(alloc, "lru")
    cache_sequence(cache, alloc, list(range(40)))
    assert all(not node.page_hashes for node, _ in walk(cache))
    queue = KVEventQueue()
    cache.enable_events(queue)
    cleared, snapshot = queue.drain()  # what a subscriber knew may be stale: forget it first
    assert isinstance(cleared, AllBlocksCleared)
    assert snapshot.block_hashes == prompt_block_hashes(range(40), 16)


def test_namespaces_never_share_a_hash():
    tokens = list(range(32))
    shared = prompt_block_hashes(tokens, 16)
    a, b = prompt_block_hashes(tokens, 16, "a"), prompt_block_hashes(tokens, 16, "b")
    assert len({*shared, *a, *b}) == 6
    # the salt is length-prefixed: a salt that ends with a token's bytes is no other salt
    assert prompt_block_hashes([0] * 16, 16, "x") != prompt_block_hashes([0] * 16, 16, "x\0")
