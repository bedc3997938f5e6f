"""RequestKV: the request side of the slot-ownership contract (see ``cache/base.py``).

Every slot is free (allocator), cached (tree) or held by one running request. This module is
the only code that moves slots between a request and the other two owners:

    admit:       match_prefix -> lock last node -> slots[:prefix_len] are the tree's
    allocate:    allocator (evicting unlocked tree leaves when short) -> slots held
    publish:     after a prefill chunk, insert the computed prefix into the tree and re-lock,
                 so queued requests sharing it hit the cache before this one finishes
    release:     on finish, abort or retraction, insert what was computed, free duplicates
                 and the unaligned tail, unlock
"""

from __future__ import annotations

import torch

from radixserve.cache import MatchResult, PagedAllocator, PrefixCache, RadixCache
from radixserve.engine.request import Request


class RequestKV:
    def __init__(self, cache: PrefixCache, allocator: PagedAllocator):
        self.cache = cache
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.caching = isinstance(cache, RadixCache)

    # ------------------------------------------------------------------ sizes
    def available(self) -> int:
        """Slots obtainable now: free ones plus everything the tree could evict."""
        return self.allocator.free_size() + self.cache.evictable_size()

    def capacity(self) -> int:
        return self.allocator.num_slots

    # ------------------------------------------------------------------ admission
    def match(self, req: Request, record_stats: bool = False) -> MatchResult:
        # At most num_tokens - 1: the last token is always computed, for its logits.
        return self.cache.match_prefix(
            req.token_ids[: req.num_tokens - 1], req.extra_key, record_stats
        )

    def admit(self, req: Request, match: MatchResult) -> None:
        self.cache.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.slots[: match.length] = match.indices
        req.prefix_len = req.num_computed = match.length

    def record_admission(self, req: Request, matched: int) -> None:
        """Count a request's cache hit once, when it is first admitted (not on resumption)."""
        if req.admitted_once:
            return
        req.admitted_once = True
        req.cached_tokens = min(matched, req.prompt_len)
        self.cache.record_hit(req.last_node, req.prompt_len, req.cached_tokens)

    # ------------------------------------------------------------------ allocation
    def _alloc_with_eviction(self, alloc, num_tokens: int) -> torch.Tensor | None:
        slots = alloc()
        if slots is None and self.caching:
            self.cache.evict(num_tokens + self.page_size - self.allocator.free_size())
            slots = alloc()
        return slots

    def extend(self, req: Request, n: int) -> bool:
        """Give ``req`` slots for its next ``n`` tokens; False (nothing taken) if impossible."""
        last = int(req.slots[req.num_computed - 1]) if req.num_computed else None
        slots = self._alloc_with_eviction(lambda: self.allocator.alloc_extend(last, n), n)
        if slots is None:
            return False
        req.slots[req.num_computed : req.num_computed + n] = slots
        return True

    def extend_decode(self, reqs: list[Request]) -> bool:
        """One slot for the pending token of each decoding request, all or nothing."""
        if self.page_size == 1:
            alloc = lambda: self.allocator.alloc(len(reqs))
        else:
            last = torch.stack([r.slots[r.num_computed - 1] for r in reqs])
            alloc = lambda: self.allocator.alloc_decode(last)
        slots = self._alloc_with_eviction(alloc, len(reqs))
        if slots is None:
            return False
        for r, s in zip(reqs, slots.tolist(), strict=True):
            r.slots[r.num_computed] = s
        return True

    # ------------------------------------------------------------------ tree updates
    def publish(self, req: Request) -> None:
        """Insert the computed prefix of a still-running request and lock it in the tree."""
        aligned = req.num_computed - req.num_computed % self.page_size
        if not self.caching or aligned <= req.prefix_len:
            return
        ids, slots = req.token_ids[:aligned], req.slots[:aligned]
        already = self.cache.insert(ids, slots, req.extra_key)
        self.allocator.free(req.slots[req.prefix_len : already])
        match = self.cache.match_prefix(ids, req.extra_key, record_stats=False)
        if match.length != aligned:
            raise AssertionError(f"published {aligned} tokens but {match.length} match")
        self.cache.inc_lock_ref(match.last_node)
        self.cache.dec_lock_ref(req.last_node)
        req.slots[:aligned] = match.indices
        req.prefix_len = aligned
        req.last_node = match.last_node

    def release(self, req: Request) -> None:
        """Hand everything back: computed tokens to the tree (or the allocator), lock dropped."""
        n = req.num_computed
        aligned = n - n % self.page_size
        already = self.cache.insert(req.token_ids[:aligned], req.slots[:aligned], req.extra_key)
        self.allocator.free(req.slots[req.prefix_len : max(already, req.prefix_len)])
        self.allocator.free(req.slots[aligned:n])  # aligned >= prefix_len: both page-aligned
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = None
        req.prefix_len = req.num_computed = 0

    def check_integrity(self, running: list[Request]) -> None:
        held = [r.held_slots() for r in running]
        self.cache.check_integrity(torch.cat(held) if held else torch.empty(0, dtype=torch.int64))
