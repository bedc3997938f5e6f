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
