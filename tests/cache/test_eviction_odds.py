"""The ``return-odds`` eviction policy: what it learns and the order it evicts in."""

from radixserve.cache import PagedAllocator, RadixCache
from radixserve.cache.eviction_odds import ReturnOddsPolicy
from testing.cache import cache_sequence, evict_order


def conversation(first: int, length: int) -> list[int]:
    return [first] + list(range(1000, 1000 + length - 1))


def test_learns_which_depths_return_and_evicts_the_unlikely_first():
    """Short conversations (depth < 32) come back, long ones (depth >= 256) never do: once
    learned, a long conversation's leaf goes before a short one's that is idle longer, where
    LRU would evict the short one first."""
    caches = {}
    for name in ("lru", "return-odds"):
        alloc = PagedAllocator(100_000, 1)
        cache = caches[name] = RadixCache(alloc, name)
        for i in range(6):
            short, long = conversation(100 + i, 20), conversation(200 + i, 300)
            cache_sequence(cache, alloc, short)
            cache_sequence(cache, alloc, long)
            cache_sequence(cache, alloc, short + list(range(2000, 2020)))  # its user returns
        cache_sequence(cache, alloc, conversation(300, 20))  # idle longest
        cache_sequence(cache, alloc, conversation(400, 300))
    policy = caches["return-odds"]._heap.policy
    assert isinstance(policy, ReturnOddsPolicy)
    short_class, long_class = 4, 8  # log2 of the depths 20 and 300
    assert policy.reused[short_class] == 6 and policy.reused[long_class] == 0
    assert policy.bonus(short_class) > 0 > policy.bonus(long_class)
    # lru: by recency, so 300 before 400; return-odds: every long one (400 cached last)
    # before the short 300
    lru_order = evict_order(caches["lru"])
    odds_order = evict_order(caches["return-odds"])
    assert lru_order.index(300) < lru_order.index(400)
    assert odds_order.index(400) < odds_order.index(300)
    assert all(odds_order.index(long) < odds_order.index(300) for long in range(200, 206))


def test_a_parent_left_by_its_evicted_leaf_is_no_likelier_than_it():
    """When a conversation's last turn is evicted, the turn before it becomes a leaf: it comes
    back only if the same conversation does, so it inherits the evicted leaf's lower value
    instead of ranking as a shallow (likely) node."""
    alloc = PagedAllocator(100_000, 1)
    cache = RadixCache(alloc, "return-odds")
    for i in range(6):  # teach: depth ~20 returns, depth ~300 does not
        cache_sequence(cache, alloc, conversation(100 + i, 20))
        cache_sequence(cache, alloc, conversation(200 + i, 300))
        cache_sequence(cache, alloc, conversation(100 + i, 20) + list(range(2000, 2020)))
    policy = cache._heap.policy
    base = conversation(500, 20)
    cache_sequence(cache, alloc, base)
    cache_sequence(cache, alloc, base + list(range(3000, 3280)))  # its long next turn
    parent = cache.match_prefix(base, record_stats=False).handle
    own = parent.last_access + policy.bonus(4)
    while parent.children:
        cache.evict(1)
        cache.check_integrity()
    assert parent in cache._evictable_leaves
    assert cache._heap.priority(parent)[0] < own
