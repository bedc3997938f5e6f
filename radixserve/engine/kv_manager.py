"""RequestKV: the request side of the slot-ownership contract (see ``cache/base.py``).

Every slot is free (allocator), cached (tree) or held by one running request. Each request
keeps one ledger (``KVLedger``) and this module is the only code that writes it::

    ledger.slots:  [0 ...... cached ...... computed ...... allocated)
                    tree-owned,            held, KV        held, reserved for
                    locked via handle      written         the step under way

    invariant: cached <= computed <= allocated

    admit:     match_prefix -> lock the handle -> cached = computed = allocated = prefix
    load:      the match's host part is copied into device slots the tree owns (the lower
               tiers' load_back),
               then locked like the rest: cached = computed = allocated = the longer prefix
    allocate:  extend / extend_decode take slots from the allocator (evicting unlocked tree
               leaves when short): allocated grows
    commit:    after a forward pass wrote their KV: computed grows (never past allocated)
    trim:      a grammar draft the model did not keep: allocated falls back to computed
    publish:   after a prefill chunk, insert the computed prefix into the tree and re-lock,
               so queued requests sharing it hit the cache before this one finishes
    release:   on finish, abort, failure or retraction: insert what was computed, free the
               duplicates and everything up to ``allocated``, unlock

A request whose KV past some token is approximate (reused RAG segments) sets a publish limit:
only the exact tokens before it ever enter the tree; the rest is freed on release.

Because ``release`` frees up to ``allocated`` whatever happened in between, an exception, an
abort or an interrupted load between ``schedule()`` and the end of a step cannot leak a slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.cache import (
    NO_TIERS,
    LowerTiers,
    MatchResult,
    PagedAllocator,
    PrefixCache,
    PrefixPeek,
)
from radixserve.cache.base import CacheHandle
from radixserve.cache.pins import PinTable


class KVLedger:
    """One request's KV slots and how far they are cached, computed and allocated."""

    __slots__ = ("slots", "cached", "computed", "allocated", "handle", "publish_limit")

    def __init__(self, capacity: int):
        self.slots = torch.empty(capacity, dtype=torch.int64)
        self.cached = 0
        self.computed = 0
        self.allocated = 0
        self.handle: CacheHandle = None
        self.publish_limit: int | None = None  # tokens past it are approximate: never cached

    def publishable(self, page_size: int) -> int:
        """How many leading tokens may enter the tree (computed, exact, whole pages)."""
        n = self.computed if self.publish_limit is None else min(self.computed, self.publish_limit)
        return n - n % page_size

    def held(self) -> torch.Tensor:
        """Slots the request owns (the tree owns ``slots[:cached]``)."""
        return self.slots[self.cached : self.allocated]

    def __repr__(self) -> str:
        return (
            f"KVLedger(cached={self.cached}, computed={self.computed}, allocated={self.allocated})"
        )


class RequestKV:
    def __init__(self, cache: PrefixCache, allocator: PagedAllocator,
                 tiers: LowerTiers = NO_TIERS):  # fmt: skip
        """``tiers``: the tiers below the device pool (loads and prefetches)."""
        self.cache = cache
        self.allocator = allocator
        self.tiers = tiers
        self.page_size = allocator.page_size
        self.pins: PinTable | None = None  # set by whoever pins prefixes (pin_requests.py)

    @property
    def reuses_prefixes(self) -> bool:
        return self.cache.reuses_prefixes

    # ------------------------------------------------------------------ sizes
    def available(self) -> int:
        """Slots obtainable now: free ones plus everything the tree could evict (and, with
        window layers kept apart, no more than the window slots obtainable)."""
        return self.cache.room()

    def unpin_for(self, num_slots: int) -> None:
        """Pins give way (least recently used first) until ``num_slots`` are obtainable: a
        request that nothing running will make room for would otherwise wait for them."""
        if self.pins is not None:
            self.pins.give_way(num_slots)

    def can_admit(self, prompt: int, output: int, reserved: int) -> bool:
        """Whether a request with ``prompt`` tokens still to compute and ``output`` slots to
        reserve fits in the device pool beside the ``reserved`` slots of running requests (a
        window pool's room is ``prefill_chunk``'s)."""
        main, _ = self.cache.obtainable()
        return prompt + output <= main - reserved

    def prefill_chunk(self, req, chunk: int, output: int | None = None) -> int:
        """How many of the tokens ``req`` still has to compute it computes next: at most
        ``chunk``, and in a window pool no more than its obtainable slots hold. A request
        being admitted (``output``: the slots it reserves) also needs room for its output
        and, unless the chunk ends its prompt, for the window before the next chunk, beyond
        the window its match already holds locked: each computed chunk enters the tree,
        where its window KV can be dropped, but for that window. A cut chunk is whole pages;
        0: no room now."""
        prompt = req.num_uncomputed
        n = min(prompt, chunk)
        _, window = self.cache.obtainable()
        if window is None:
            return n
        room = window
        if output is not None:
            room -= output
            if n < prompt or n > room:  # more chunks follow this one
                room -= self._window_to_lock(req.kv.cached)
        if n <= room:
            return n
        return max(room - room % self.page_size, 0)

    def _window_to_lock(self, resume: int) -> int:
        """Window slots a request resuming at ``resume`` (a page boundary, as every point the
        tree locks at is) will lock beyond those it holds locked now, once it resumes past
        the window: from the page holding the first token of the window before its resume
        point (``WindowKeeper.on_lock``)."""
        held = resume - self.allocator.window_start(resume)
        return max(self.allocator.window_span - held, 0)

    def capacity(self) -> int:
        return self.allocator.num_slots

    # ------------------------------------------------------------------ admission
    # A match covers at most num_tokens - 1 tokens: the last one is always computed, for its
    # logits.
    def match(self, req) -> MatchResult:
        return self.cache.match_prefix(req.token_ids[:-1], req.namespace, record_stats=False)

    def peek(self, req) -> PrefixPeek:
        """How much of ``req`` is cached, without touching the cache (scheduling policies)."""
        return self.cache.peek_prefix(req.token_ids[:-1], req.namespace)

    def admit(self, req, match: MatchResult) -> None:
        kv: KVLedger = req.kv
        if kv.allocated:
            raise RuntimeError(f"{req!r} is admitted while it still holds slots")
        self.cache.inc_lock_ref(match.handle)
        kv.handle = match.handle
        kv.slots[: match.device_len] = match.device_indices
        kv.cached = kv.computed = kv.allocated = match.device_len
        kv.publish_limit = None

    def limit_publish(self, req, n: int) -> None:
        """Tokens from ``n`` on are approximate: never insert them into the tree."""
        kv: KVLedger = req.kv
        if n < kv.cached:
            raise RuntimeError(f"{req!r}: publish limit {n} below its cached prefix")
        kv.publish_limit = n if kv.publish_limit is None else min(kv.publish_limit, n)

    def load(self, req, match: MatchResult) -> int:
        """Bring the host part of an admitted request's match onto the device (when the cache
        finds it worth it) and lock the longer prefix; returns the tokens loaded."""
        kv: KVLedger = req.kv
        if not match.host_len:
            return 0
        loaded = self.tiers.load_back(match)
        if loaded.device_len <= kv.cached:
            return 0
        self.cache.inc_lock_ref(loaded.handle)
        self.cache.dec_lock_ref(kv.handle)
        kv.handle = loaded.handle
        kv.slots[: loaded.device_len] = loaded.device_indices
        gained = loaded.device_len - kv.cached
        kv.cached = kv.computed = kv.allocated = loaded.device_len
        return gained

    def start_prefetch(self, req) -> None:
        """A new request whose prompt runs past the cached prefix: ask the storage tier for
        the rest now, while it waits (the scheduler admits it once the pages are in)."""
        if not req.admitted_once:
            req.tier.prefetch = self.tiers.start_prefetch(req.token_ids[:-1], req.namespace)

    def awaiting_pages(self, req, now: float) -> bool:
        """Whether ``req`` still waits for its prefetch (False once done or timed out)."""
        p = req.tier.prefetch
        if p is None or p.done:
            return False
        if p.expired(now):
            p.give_up()  # compute the pages instead; a late fetch still fills the tree
            return False
        return True

    def record_admission(self, req, device_tokens: int, loaded_tokens: int = 0) -> bool:
        """Count a request's cache hit once, when it is first admitted (not on resumption):
        ``device_tokens`` matched on the device, then ``loaded_tokens`` loaded from the lower
        tiers (those its own prefetch brought count as storage hits, the rest as host hits).
        True when this was its first admission (its usage is now final)."""
        if req.admitted_once:
            return False
        req.admitted_once = True
        p, req.tier.prefetch = req.tier.prefetch, None
        storage = p.tokens_from_storage(device_tokens, device_tokens + loaded_tokens) if p else 0
        cached = min(device_tokens + loaded_tokens, req.prompt_len)
        host = loaded_tokens - storage
        req.add_usage(cached_tokens=cached, host_cached_tokens=host, storage_cached_tokens=storage,
                      admitted=True)  # fmt: skip
        self.cache.record_hit(req.kv.handle, req.prompt_len, cached, host, storage)
        return True

    # ------------------------------------------------------------------ allocation
    def _alloc_with_eviction(
        self, alloc: Callable[[], torch.Tensor | None], num_tokens: int
    ) -> torch.Tensor | None:
        slots = alloc()
        if slots is None:
            self.cache.make_room(num_tokens + self.page_size)
            slots = alloc()
        return slots

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        """``n`` fresh slots for the caller to hand to the tree (evicting when short)."""
        return self._alloc_with_eviction(lambda: self.allocator.alloc(n), n)

    def extend(self, req, n: int) -> bool:
        """Give ``req`` slots for its next ``n`` tokens; False (nothing taken) if impossible."""
        kv: KVLedger = req.kv
        last = int(kv.slots[kv.allocated - 1]) if kv.allocated else None
        slots = self._alloc_with_eviction(lambda: self.allocator.alloc_extend(last, n), n)
        if slots is None:
            return False
        kv.slots[kv.allocated : kv.allocated + n] = slots
        kv.allocated += n
        return True

    def extend_decode(self, reqs: list) -> bool:
        """One slot for the pending token of each decoding request, all or nothing."""
        if self.page_size == 1:
            alloc = lambda: self.allocator.alloc(len(reqs))
        else:
            last = torch.stack([r.kv.slots[r.kv.allocated - 1] for r in reqs])
            alloc = lambda: self.allocator.alloc_decode(last)
        slots = self._alloc_with_eviction(alloc, len(reqs))
        if slots is None:
            return False
        for r, s in zip(reqs, slots.tolist(), strict=True):
            r.kv.slots[r.kv.allocated] = s
            r.kv.allocated += 1
        return True

    def commit(self, req, n: int) -> None:
        """The KV of ``req``'s next ``n`` tokens is now written in the pool."""
        kv: KVLedger = req.kv
        if kv.computed + n > kv.allocated:
            raise RuntimeError(f"{req!r}: committing {n} tokens beyond its allocated slots")
        kv.computed += n

    def trim(self, req) -> None:
        """Give back the slots allocated past ``computed`` (a draft the model did not keep):
        whole pages past the one holding the last computed token go to the allocator."""
        kv: KVLedger = req.kv
        start = -(-kv.computed // self.page_size) * self.page_size
        if start < kv.allocated:
            self.allocator.free(kv.slots[start : kv.allocated])
        kv.allocated = kv.computed

    # ------------------------------------------------------------------ tree updates
    def publish(self, req) -> None:
        """Insert the computed prefix of a still-running request and lock it in the tree."""
        kv: KVLedger = req.kv
        aligned = kv.publishable(self.page_size)
        if not self.reuses_prefixes or aligned <= kv.cached:
            return
        ids, slots = req.token_ids[:aligned], kv.slots[:aligned]
        already = self.cache.insert(ids, slots, req.namespace)
        self.allocator.free(kv.slots[kv.cached : already])
        match = self.cache.match_prefix(ids, req.namespace, record_stats=False)
        if match.device_len != aligned:
            raise AssertionError(f"published {aligned} tokens but {match.device_len} match")
        self.cache.inc_lock_ref(match.handle)
        self.cache.dec_lock_ref(kv.handle)
        kv.slots[:aligned] = match.device_indices
        kv.cached = aligned
        kv.handle = match.handle

    def release(self, req) -> None:
        """Hand everything back: computed tokens to the tree (or the allocator), every other
        allocated slot to the allocator, the lock dropped. Safe at any point of a step."""
        kv: KVLedger = req.kv
        aligned = kv.publishable(self.page_size)
        if aligned > kv.cached:
            already = self.cache.insert(req.token_ids[:aligned], kv.slots[:aligned], req.namespace)
            self.allocator.free(kv.slots[kv.cached : max(already, kv.cached)])
        else:
            aligned = kv.cached
        self.allocator.free(kv.slots[aligned : kv.allocated])  # page-aligned start: whole pages
        self.cache.dec_lock_ref(kv.handle)
        kv.handle = None
        kv.cached = kv.computed = kv.allocated = 0
        kv.publish_limit = None

    def check_integrity(self, running: list) -> None:
        held = [r.kv.held() for r in running]
        self.cache.check_integrity(torch.cat(held) if held else torch.empty(0, dtype=torch.int64))
