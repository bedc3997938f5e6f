"""The ``reuse`` eviction policy: what it learns, what it keeps, and the predictions and
outcomes it reports."""

from radixserve.cache import PagedAllocator, RadixCache
from radixserve.cache.eviction_base import EvictionPolicy
from radixserve.cache.eviction_reuse import ReusePolicy
from testing.cache import cache_sequence


def test_an_evicted_prefix_cached_again_counts_as_returned():
    alloc = PagedAllocator(1000, 1)
    cache = RadixCache(alloc, "reuse")
    a, b = list(range(1, 41)), list(range(100, 140))
    cache_sequence(cache, alloc, a)
    cache_sequence(cache, alloc, b)
    cache.evict(1)  # one whole leaf goes
    stats = cache.eviction_stats()
    assert stats.policy == "reuse" and stats.evicted_leaves == 1
    assert 0 < stats.predicted_returns < 1 and stats.returned_leaves == 0
    gone = a if cache.match_prefix(a, record_stats=False).device_len == 0 else b
    assert cache_sequence(cache, alloc, gone) == 0  # computed again: it came back
    stats = cache.eviction_stats()
    assert stats.returned_leaves == 1 and stats.returned_tokens == 40
    assert RadixCache(PagedAllocator(100, 1), "lru").eviction_stats() is None


def replay_hits(policy: str | EvictionPolicy) -> int:
    """Chats that come back after ten one-off documents, in a pool too small for LRU to keep
    them: each step caches one new 200-token document and a chat turn (turn 2 of chat i at
    step i + 10). Returns the tokens of second turns served from the cache."""
    alloc = PagedAllocator(1500, 1)
    cache = RadixCache(alloc, policy)
    chat = [[10_000 * (i + 1) + t for t in range(40)] for i in range(80)]
    hits = 0
    for step in range(80):
        cache_sequence(cache, alloc, [10_000_000 + 1000 * step + t for t in range(200)])
        cache_sequence(cache, alloc, chat[step])
        if step >= 10:
            turn = chat[step - 10] + [7, 8, 9]
            hits += cache_sequence(cache, alloc, turn) or 0
        cache.check_integrity()
    return hits


def test_learns_that_documents_do_not_return_and_keeps_the_chats_that_do():
    """LRU drops every chat before its user is back (ten documents are newer); ``reuse``
    learns online that documents never come back and chats do, and evicts documents first."""
    lru, reuse = replay_hits("lru"), replay_hits("reuse")
    assert lru == 0
    assert reuse >= 40 * 60  # most of the 70 second turns (LRU: none)


def test_a_policy_handed_to_the_tree_is_bound_to_it_and_can_start_from_a_prior():
    """A ``ReusePolicy`` built by the caller ranks with the tree's touch clock, as the one
    the tree builds by name does; one started from a model learned on the same traffic keeps
    the early chats the fresh one drops while it learns."""
    assert replay_hits(ReusePolicy()) == replay_hits("reuse")
    first = ReusePolicy()
    cold = replay_hits(first)
    warm = ReusePolicy(prior=first.model)
    assert replay_hits(warm) > cold
    assert warm.model.counts is not first.model.counts  # the prior is copied, not shared
