"""Helpers for cache tests: the request-side protocol of the ownership contract."""

from __future__ import annotations

import torch

from radixserve.cache import PagedAllocator, PrefixCache


def cache_sequence(cache: PrefixCache, alloc: PagedAllocator, tokens: list[int], namespace=None):
    """Do what a finishing request does: match, allocate the rest, insert, free duplicates.

    Returns the number of tokens that were already cached, or None if the pool is too small
    even after evicting everything evictable.
    """
    match = cache.match_prefix(tokens, namespace)
    cache.inc_lock_ref(match.handle)
    need = len(tokens) - match.device_len
    new = alloc.alloc(need)
    if new is None:
        cache.evict(need - alloc.free_size())
        new = alloc.alloc(need)
    if new is None:
        cache.dec_lock_ref(match.handle)
        return None
    slots = torch.cat([match.device_indices, new])
    aligned = len(tokens) // alloc.page_size * alloc.page_size
    already = cache.insert(tokens[:aligned], slots[:aligned], namespace)
    alloc.free(slots[match.device_len : max(already, match.device_len)])
    alloc.free(slots[aligned:])
    cache.dec_lock_ref(match.handle)
    return already


# The reference the radix-tree state machines check against: every cached
# (namespace, page-aligned prefix) mapped to the slots of its last page.
Reference = dict[tuple, torch.Tensor]


def reference_match(ref: Reference, page_size: int, ns, tokens) -> tuple[int, torch.Tensor]:
    """The longest page-aligned prefix of ``tokens`` the reference holds, and its slots."""
    n, runs = 0, []
    while n + page_size <= len(tokens) and (ns, tuple(tokens[: n + page_size])) in ref:
        n += page_size
        runs.append(ref[(ns, tuple(tokens[:n]))])
    return n, (torch.cat(runs) if runs else torch.empty(0, dtype=torch.int64))


def reference_add(ref: Reference, page_size: int, ns, tokens, slots: torch.Tensor,
                  start: int, end: int) -> None:  # fmt: skip
    """Record the pages of ``tokens`` from ``start`` to ``end`` as cached at ``slots``."""
    for stop in range(start + page_size, end + 1, page_size):
        ref[(ns, tuple(tokens[:stop]))] = slots[stop - page_size : stop]


def evict_order(cache):
    """Evict leaf by leaf; return each evicted leaf's first token."""
    order = []
    while cache.evictable_size():
        before = {id(leaf): int(leaf.key[0]) for leaf in cache._evictable_leaves}
        cache.evict(1)
        after = {id(leaf) for leaf in cache._evictable_leaves}
        order += [t for i, t in before.items() if i not in after]
        cache.check_integrity()
    return order
