import numpy as np
import pytest
import torch

from radixserve.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventQueue,
    NullCache,
    PagedAllocator,
    RadixCache,
)
from testing.cache import cache_sequence

NO_HELD = torch.empty(0, dtype=torch.int64)


def make(capacity=256, page_size=1, policy="lru", events=None, block_size=None):
    alloc = PagedAllocator(capacity, page_size)
    cache = RadixCache(alloc, policy, event_queue=events, event_block_size=block_size)
    return cache, alloc


def test_insert_then_match_returns_the_same_slots():
    cache, alloc = make()
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (
        m.device_len == 5
        and torch.equal(m.device_indices, slots)
        and m.device_indices.dtype == torch.int64
    )
    assert cache.match_prefix([9, 1]).device_len == 0
    assert cache.total_size() == 5 and cache.evictable_size() == 5
    cache.check_integrity(held_indices=NO_HELD)


def test_match_splits_an_edge_without_changing_content():
    cache, alloc = make()
    slots = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], slots)
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.device_len == 3 and torch.equal(m.device_indices, slots[:3])
    assert cache.summary().num_nodes == 2  # the edge was split in two
    assert cache.total_size() == 6
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices, slots)
    cache.check_integrity(held_indices=NO_HELD)


def test_insert_returns_already_cached_prefix_and_branches():
    cache, alloc = make()
    assert cache_sequence(cache, alloc, [1, 2, 3, 4]) == 0
    assert cache_sequence(cache, alloc, [1, 2, 3, 4, 5, 6]) == 4
    assert cache_sequence(cache, alloc, [1, 2, 7, 8]) == 2
    assert cache.total_size() == 8  # 1 2 3 4 5 6 + 7 8
    assert alloc.free_size() == 256 - 8
    cache.check_integrity(held_indices=NO_HELD)


def test_insert_of_duplicate_slots_leaves_caller_owning_them():
    cache, alloc = make()
    a = alloc.alloc(4)
    b = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], a)
    assert cache.insert([1, 2, 3, 4], b) == 4
    with pytest.raises(AssertionError, match="leaked"):
        cache.check_integrity(held_indices=NO_HELD)
    alloc.free(b)
    cache.check_integrity(held_indices=NO_HELD)


def test_insert_rejects_mismatched_lengths():
    cache, alloc = make()
    with pytest.raises(ValueError, match="3 tokens but 2"):
        cache.insert([1, 2, 3], alloc.alloc(2))


def test_page_alignment():
    cache, alloc = make(capacity=64, page_size=4)
    tokens = list(range(10))
    assert cache_sequence(cache, alloc, tokens) == 0
    assert cache.total_size() == 8  # the partial third page is not cached
    m = cache.match_prefix(tokens[:7])
    assert m.device_len == 4 and m.device_indices[0] % 4 == 0
    m = cache.match_prefix(list(range(6)) + [99, 99])  # diverges inside page 2
    assert m.device_len == 4
    cache.check_integrity(held_indices=NO_HELD)
    assert cache_sequence(cache, alloc, list(range(6)) + [50, 51]) == 4
    assert cache.total_size() == 12
    cache.check_integrity(held_indices=NO_HELD)


def test_namespaces_never_share_nodes():
    cache, alloc = make()
    cache_sequence(cache, alloc, [1, 2, 3], namespace="lora-a")
    assert cache.match_prefix([1, 2, 3]).device_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="lora-b").device_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="lora-a").device_len == 3
    assert cache_sequence(cache, alloc, [1, 2, 3]) == 0
    assert cache.total_size() == 6
    cache.reset()
    assert cache.total_size() == 0 and list(cache._roots) == [None]  # empty namespace dropped
    cache.check_integrity(held_indices=NO_HELD)


def test_lock_moves_sizes_between_evictable_and_protected():
    cache, alloc = make()
    cache_sequence(cache, alloc, [1, 2, 3, 4])
    cache_sequence(cache, alloc, [1, 2, 5, 6, 7])
    m = cache.match_prefix([1, 2, 5, 6, 7])
    cache.inc_lock_ref(m.handle)
    assert cache.protected_size() == 5 and cache.evictable_size() == 2
    cache.inc_lock_ref(m.handle)
    assert cache.protected_size() == 5
    cache.dec_lock_ref(m.handle)
    assert cache.protected_size() == 5
    cache.dec_lock_ref(m.handle)
    assert cache.protected_size() == 0 and cache.evictable_size() == 7
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(m.handle)
    cache.check_integrity(held_indices=NO_HELD)


def test_locked_prefixes_survive_eviction_and_reset():
    cache, alloc = make()
    cache_sequence(cache, alloc, [1, 2, 3, 4])
    cache_sequence(cache, alloc, [1, 2, 8, 9])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.handle)
    assert cache.evict(100) == 2  # only [8, 9] was evictable
    assert cache.reset() == 0
    assert cache.match_prefix([1, 2, 3, 4]).device_len == 4
    cache.dec_lock_ref(m.handle)
    assert cache.reset() == 4 and cache.total_size() == 0
    assert alloc.free_size() == 256
    cache.check_integrity(held_indices=NO_HELD)


def test_lru_evicts_least_recently_used_leaf_first():
    cache, alloc = make()
    for seq in ([1, 1], [2, 2], [3, 3]):
        cache_sequence(cache, alloc, seq)
    cache.match_prefix([1, 1])  # touch: [2, 2] is now the oldest
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).device_len == 0
    assert cache.match_prefix([1, 1]).device_len == 2 and cache.match_prefix([3, 3]).device_len == 2


def test_lfu_evicts_least_frequently_hit_leaf_first():
    cache, alloc = make(policy="lfu")
    for seq in ([1, 1], [2, 2], [3, 3]):
        cache_sequence(cache, alloc, seq)
    for _ in range(3):
        cache.match_prefix([1, 1])
        cache.match_prefix([3, 3])
    cache.match_prefix([2, 2])  # most recent, but hit only once
    cache.evict(1)
    assert cache.match_prefix([2, 2], record_stats=False).device_len == 0
    assert cache.match_prefix([1, 1]).device_len == 2


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make(policy="mru")


def test_eviction_cascades_to_parents_that_become_leaves():
    cache, alloc = make()
    cache_sequence(cache, alloc, [1, 2, 3])
    cache_sequence(cache, alloc, [1, 2, 4])  # [1,2] is an inner node with two leaves
    assert cache.evict(3) == 4  # both leaves, then their parent
    assert cache.total_size() == 0
    cache.check_integrity(held_indices=NO_HELD)


def test_evict_frees_at_least_what_was_asked_when_possible():
    cache, alloc = make()
    for i in range(10):
        cache_sequence(cache, alloc, [100 + i] * 7)
    freed = cache.evict(15)
    assert freed >= 15 and cache.total_size() == 70 - freed
    assert alloc.free_size() == 256 - cache.total_size()


def test_counters_track_lookups_hits_and_evictions():
    cache, alloc = make()
    cache_sequence(cache, alloc, [1, 2, 3, 4])  # one lookup of 4 tokens, 0 hit
    cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.match_prefix([1, 2], record_stats=False)  # splits the edge: two nodes now
    cache.evict(4)
    s = cache.stats
    assert (s.lookups, s.lookup_tokens, s.hit_tokens) == (2, 10, 4)
    assert (s.evicted_tokens, s.evictions, s.evict_calls) == (4, 2, 1)


def test_events_name_pages_by_chained_hash():
    events = KVEventQueue()
    cache, alloc = make(capacity=64, page_size=2, events=events, block_size=2)
    cache_sequence(cache, alloc, [1, 2, 3, 4])
    cache_sequence(cache, alloc, [1, 2, 3, 4, 5, 6])
    cache_sequence(cache, alloc, [1, 2, 3, 4], namespace="tenant")
    stored = events.drain()
    assert [type(e) for e in stored] == [BlockStored] * 3
    first, second, other = stored
    assert len(first.block_hashes) == 2 and first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[-1] and second.token_ids == [5, 6]
    assert other.block_hashes != first.block_hashes  # namespaces salt the hash
    cache.match_prefix([1, 2, 9, 9])  # a split keeps every page's hash
    cache.check_integrity(held_indices=NO_HELD)
    cache.reset()
    removed = events.drain()
    assert {h for e in removed[:-1] for h in e.block_hashes} == {
        h for e in stored for h in e.block_hashes
    }
    assert isinstance(removed[-1], AllBlocksCleared)
    assert all(isinstance(e, BlockRemoved) for e in removed[:-1])


def test_summary_reports_shared_prefixes():
    cache, alloc = make()
    cache_sequence(cache, alloc, list(range(20)) + [1])
    cache_sequence(cache, alloc, list(range(20)) + [2])
    s = cache.summary()
    assert s.num_nodes == 3 and s.cached_tokens == 22
    assert s.top_prefixes[0]["prefix_tokens"] == 20
    assert s.top_prefixes[0]["head_token_ids"] == list(range(16))


def test_match_accepts_lists_numpy_and_tensors():
    cache, alloc = make()
    cache_sequence(cache, alloc, [5, 6, 7])
    for ids in ([5, 6, 7], np.array([5, 6, 7]), torch.tensor([5, 6, 7])):
        assert cache.match_prefix(ids).device_len == 3


def test_null_cache_caches_nothing_and_frees_on_insert():
    alloc = PagedAllocator(32)
    cache = NullCache(alloc)
    assert cache_sequence(cache, alloc, [1, 2, 3]) == 0
    assert cache.match_prefix([1, 2, 3]).device_len == 0
    assert cache.total_size() == 0 and alloc.free_size() == 32
    cache.check_integrity(held_indices=NO_HELD)


@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_pressure_ends_without_leaks(page_size):
    rng = np.random.default_rng(0)
    cache, alloc = make(capacity=512, page_size=page_size)
    system = rng.integers(0, 50, 64).tolist()
    inserted = 0
    for _ in range(300):
        tail = rng.integers(0, 50, int(rng.integers(1, 100))).tolist()
        seq = (system if rng.random() < 0.7 else []) + tail
        if cache_sequence(cache, alloc, seq) is not None:
            inserted += 1
        assert cache.total_size() + alloc.free_size() == 512
    cache.check_integrity(held_indices=NO_HELD)
    assert inserted == 300 and cache.stats.evicted_tokens > 512
    cache.reset()
    assert alloc.free_size() == 512
    cache.check_integrity(held_indices=NO_HELD)
