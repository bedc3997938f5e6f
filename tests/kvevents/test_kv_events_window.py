"""KV events of a tree whose window layers keep their KV apart: window-less blocks.

A device block is window-less when any of its tokens lies in a tombstone. The events of the
window-less medium must name exactly those blocks through tombstoning, revival, splits,
evictions, resets, a node loaded from a host copy without window KV, and events switched off
and on again (a snapshot); they come after the device's ``BlockStored`` of a block and before
its ``BlockRemoved``. A router index rebuilt from the stream cuts a match back where the
engine does: exactly when a block is a page, and never past the engine's cut otherwise.
"""

import numpy as np
import pytest
import torch

from radixserve.cache import KVEventQueue, KVPool, KVShape, RadixCache
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.tier_controller import TierController
from radixserve.cache.tree_check import walk
from radixserve.cache.window_pages import WindowedAllocator
from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.kvevents.types import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    medium_window,
    windowless_medium,
)
from radixserve.router.policy import PolicyConfig, make_policy

NO_HELD = torch.empty(0, dtype=torch.int64)


class WindowMirror:
    """A subscriber that knows the window-less medium: device blocks (hash -> parent, tokens)
    and the window-less ones among them; it checks the order the events promise."""

    def __init__(self, window: int):
        self.window = window
        self.device: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.windowless: set[int] = set()
        self.revived = 0  # blocks that became whole again while staying on the device

    def apply(self, events) -> None:
        unmarked: set[int] = set()
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.device.clear()
                self.windowless.clear()
                continue
            window = medium_window(e.medium)
            assert window in (None, self.window)
            if window is None and e.medium != MEDIUM_DEVICE:
                continue  # the host tier's blocks
            if isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    if window is None:
                        assert h in self.device and h not in self.windowless, "marked at removal"
                        del self.device[h]
                    else:
                        assert h in self.windowless, "unmarked a block never marked"
                        self.windowless.discard(h)
                        unmarked.add(h)
                continue
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                tokens = tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                if window is None:
                    assert h not in self.device, "a block stored twice"
                    assert parent is None or parent in self.device, "stored before its parent"
                    self.device[h] = (parent, tokens)
                else:
                    assert self.device.get(h) == (parent, tokens), "marked a block not stored"
                    assert h not in self.windowless, "marked twice"
                    self.windowless.add(h)
                parent = h
        self.revived += len(unmarked & self.device.keys())


def expected_blocks(cache: RadixCache) -> tuple[set[int], set[int]]:
    """Every device block, and the window-less ones, computed from scratch."""
    device, windowless = set(), set()
    block = cache.event_block_size
    for node, _ in walk(cache):
        if node.value is None:
            continue
        path, n = [], node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        tokens = np.concatenate([p.key for p in path[::-1]])
        tomb = np.concatenate([np.full(len(p.key), not p.window) for p in path[::-1]])
        hashes = prompt_block_hashes(tokens, block, node.namespace)
        for i in range((len(tokens) - len(node.key)) // block, len(tokens) // block):
            device.add(hashes[i])
            if tomb[i * block : (i + 1) * block].any():
                windowless.add(hashes[i])
    return device, windowless


def cache_windowed(cache: RadixCache, alloc: WindowedAllocator, tokens, ns=None) -> None:
    """What a finishing request does (tombstones in what it recomputes are revived)."""
    m = cache.match_prefix(tokens, ns)
    cache.inc_lock_ref(m.handle)
    aligned = len(tokens) // alloc.page_size * alloc.page_size
    need = aligned - m.device_len
    new = alloc.alloc(need)
    if new is None:
        cache.evict(need - alloc.free_size())
        cache.evict_windows(need - alloc.window_free_size())
        new = alloc.alloc(need)
    if new is not None:
        slots = torch.cat([m.device_indices, new])
        already = cache.insert(tokens[:aligned], slots, ns)
        alloc.free(slots[m.device_len : already])
    cache.dec_lock_ref(m.handle)


def test_tombstoning_and_revival_name_exactly_the_blocks():
    alloc = WindowedAllocator(64, 1, 16, window=4)
    queue = KVEventQueue()
    cache = RadixCache(alloc, "lru", queue, event_block_size=4)
    seq = list(range(1, 11))
    cache_windowed(cache, alloc, seq)
    hashes = prompt_block_hashes(seq, 4)  # blocks [1..4], [5..8]; 9, 10 are no whole block
    (stored,) = queue.drain()
    assert stored.block_hashes == hashes and stored.medium == MEDIUM_DEVICE
    # the leaf keeps window KV for its last W - 1 = 3 tokens: [1..7] is tombstoned, and so
    # are both blocks, the second straddling the tombstone's end ([5..7] of [5..8])
    assert cache.evict_windows(1) == 7
    marked = queue.drain()
    medium = windowless_medium(4)
    assert [(type(e), e.medium, e.block_hashes) for e in marked] == [
        (BlockStored, medium, [hashes[0]]), (BlockStored, medium, [hashes[1]])
    ]  # fmt: skip
    assert [e.token_ids for e in marked] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert marked[1].parent_block_hash == hashes[0]
    # a late subscriber gets the tombstones in the snapshot
    cache.disable_events()
    cache.enable_events(queue)
    mirror = WindowMirror(4)
    mirror.apply(queue.drain())
    assert mirror.windowless == set(hashes) and set(mirror.device) == set(hashes)
    # recomputing [1..6] revives [1..6]: block 1 is whole again, block 2 still holds 7
    cache_windowed(cache, alloc, seq[:6])
    (revived,) = queue.drain()
    assert (type(revived), revived.medium, revived.block_hashes) == (
        BlockRemoved, medium, [hashes[0]]
    )  # fmt: skip
    cache_windowed(cache, alloc, seq[:7])  # and [7] too: block 2 is whole again
    (revived,) = queue.drain()
    assert (type(revived), revived.block_hashes) == (BlockRemoved, [hashes[1]])
    assert expected_blocks(cache) == (set(hashes), set())
    cache.check_integrity(held_indices=NO_HELD)


def test_a_node_loaded_without_window_kv_arrives_window_less():
    """A host copy made of a tombstone (write_back) loads back as a tombstone: its blocks are
    announced on the device, then window-less."""
    alloc = WindowedAllocator(32, 4, 16, window=8)
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    window_layers=(0,))  # fmt: skip
    pool = KVPool(shape, alloc.num_slots, "cpu", alloc.window_map, alloc.window_slots)
    queue = KVEventQueue()
    cache = RadixCache(alloc, "lru", queue, event_block_size=4)
    tiers = TierController(cache, HostKVPool(pool, 64, 4), "write_back")
    seq = list(range(16))
    cache_windowed(cache, alloc, seq)
    assert cache.evict_windows(1) == 8  # [0..8) is tombstoned, [8..16) keeps its window KV
    cache.evict(32)  # copied to the host (the first node without window KV), off the device
    hashes = prompt_block_hashes(seq, 4)
    events = queue.drain()
    brief = [(type(e).__name__, e.medium, e.block_hashes) for e in events]
    assert brief[0] == ("BlockStored", "device", hashes)
    assert brief[1] == ("BlockStored", "windowless:8", hashes[:2])  # only the upper node's
    mirror = WindowMirror(8)
    mirror.apply(events)  # withdrawn before the device blocks go
    assert not mirror.device and not mirror.windowless
    loaded = tiers.load_back(cache.match_prefix(seq + [99]))
    assert loaded.device_len == 16
    back = queue.drain()
    assert [(type(e).__name__, e.medium) for e in back] == [
        ("BlockStored", "device"), ("BlockStored", "windowless:8"), ("BlockStored", "device")
    ]  # fmt: skip
    assert back[1].block_hashes == hashes[:2] and back[1].token_ids == seq[:8]
    mirror.apply(back)
    assert expected_blocks(cache) == (set(mirror.device), mirror.windowless)
    assert mirror.windowless == set(hashes[:2]) and set(mirror.device) == set(hashes)
    cache.check_integrity(NO_HELD)


@pytest.mark.parametrize(
    "page_size,block_size,window",
    [(1, 1, 4), (16, 16, 40), (1, 4, 5), (16, 32, 40)],
    ids=["page1", "page16", "page1-block4", "page16-block32"],
)
def test_a_replayed_stream_cuts_matches_where_the_engine_does(page_size, block_size, window):
    rng = np.random.default_rng(page_size * 1000 + block_size)
    capacity = 64 * page_size if page_size > 1 else 96
    alloc = WindowedAllocator(capacity, page_size, capacity // 3, window)
    queue = KVEventQueue()
    cache = RadixCache(alloc, "lru", queue, event_block_size=block_size)
    cache.set_turn_end_ids([2])  # paths are cut after it, and its windows kept longer
    policy = make_policy("cache-aware", PolicyConfig(block_size=block_size))
    policy.add_worker("w", has_events=True)
    mirror, on, seen = WindowMirror(window), True, []
    systems = [rng.integers(0, 3, int(rng.integers(1, 5)) * page_size).tolist() for _ in range(3)]
    exact = cut = revived = 0
    for step in range(300):
        op = rng.random()
        ns = None if rng.random() < 0.8 else "tenant-b"
        if op < 0.55:
            head = systems[int(rng.integers(3))] if rng.random() < 0.7 else []
            seq = head + rng.integers(0, 3, int(rng.integers(1, 6)) * page_size).tolist()
            cache_windowed(cache, alloc, seq, ns)
            seen.append((ns, seq))
        elif op < 0.7 and seen:  # a match splits an edge, and may cut at a tombstone
            ns, seq = seen[int(rng.integers(len(seen)))]
            cache.match_prefix(seq[: int(rng.integers(1, len(seq) + 1))], ns, record_stats=False)
        elif op < 0.85:
            cache.evict_windows(int(rng.integers(1, capacity // 3)))
        elif op < 0.93:
            cache.evict(int(rng.integers(1, capacity // 2)))
        elif op < 0.95:
            cache.reset()
        elif on:  # the subscriber left: the router forgets, the tree stops hashing
            cache.disable_events()
            policy.worker_lost_events("w")
            revived += mirror.revived
            mirror, on = WindowMirror(window), False
        if not on and rng.random() < 0.2:
            cache.enable_events(queue)  # a snapshot, tombstones included
            on = True
        if not on:
            continue
        events = queue.drain()
        mirror.apply(events)
        policy.apply_events("w", events)
        device, windowless = expected_blocks(cache)
        assert set(mirror.device) == device and mirror.windowless == windowless, f"step {step}"
        cache.check_integrity(held_indices=NO_HELD)
        for ns, seq in seen[-8:]:
            hashes = prompt_block_hashes(seq, block_size, ns)
            held = policy.index.depth_of("w", hashes, len(hashes), now=0.0)
            assert held == sum(1 for _ in iter_held(hashes, device))
            resumable = policy.index.resumable("w", hashes, held, block_size) * block_size
            engine = cache.peek_prefix(seq[: held * block_size], ns).length
            if block_size == page_size:
                assert resumable == engine, f"step {step}"
            else:  # block granularity: never past the engine's cut, and a point it resumes at
                assert resumable <= engine
                assert cache.peek_prefix(seq[:resumable], ns).length == resumable
            exact += resumable == engine
            cut += resumable < held * block_size
    assert revived + mirror.revived > 0 and cut > 0 and exact > 0


def iter_held(hashes, device):
    for h in hashes:
        if h not in device:
            return
        yield h
