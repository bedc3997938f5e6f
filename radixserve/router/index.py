"""Which workers hold which KV blocks: exact entries from KV events, approximate ones from
routing decisions.

Pure data structure: no I/O, no clock (``now`` is passed in, in seconds), so the simulator
drives it with simulated time. Blocks are named by chained hashes (``kvevents.hashing``): a
worker holding block ``i`` of a prompt holds its whole prefix, so a worker's match for a
prompt is the number of leading block hashes it holds.

- Exact: ``hash -> {worker: tiers}`` (a bit per medium: device, host, storage), fed by the
  workers' ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events. A per-worker set
  lets a dead worker's entries go in O(its entries).
- Window-less: ``worker -> hashes`` of its device blocks without the sliding-window layers'
  KV (the medium ``windowless_medium(W)``, ``kvevents/types.py``) and its ``W``. The engine
  resumes a cached prefix only where the ``W - 1`` tokens before the resume point have that
  KV, so ``resumable`` cuts a worker's match back the same way, block by block: to the start
  of the last window-less block overlapping the ``W - 1`` tokens before the end, again until
  none does. A worker that sent no such block is not cut. Mediums the index does not know
  are skipped, never taken for the device.
- Approximate: ``hash -> {worker: expiry}``, inserted when a request is routed (the worker is
  about to compute those blocks), until an event confirms or removes the block, or the entry
  expires. For workers that publish no events it is the only knowledge. Expiry is lazy on
  lookup; ``sweep`` frees expired entries in insertion order (one TTL per worker, so the FIFO
  is ordered by expiry), amortised O(1) per entry.

Lookups never visit every worker: ``deepest`` is O(prompt blocks) dict probes, and
``candidates`` stops after ``limit`` workers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from random import Random

from radixserve.kvevents.types import MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE, medium_window

TIER_BITS = {MEDIUM_DEVICE: 1, MEDIUM_HOST: 2, MEDIUM_STORAGE: 4}


class BlockIndex:
    def __init__(self) -> None:
        self._exact: dict[int, dict[str, int]] = {}
        self._approx: dict[int, dict[str, float]] = {}
        self._exact_by_worker: dict[str, set[int]] = {}
        self._approx_by_worker: dict[str, set[int]] = {}
        self._expiries: deque[tuple[float, int, str]] = deque()
        self.lower_tier_entries = 0  # exact entries not on the device: tier costs apply
        self._windowless: dict[str, set[int]] = {}  # device blocks without window-layer KV
        self._window: dict[str, int] = {}  # the window W of a worker's window-less blocks

    # ------------------------------------------------------------------ exact (events)
    def store(self, worker: str, hashes: Iterable[int], medium: str = MEDIUM_DEVICE) -> None:
        window = medium_window(medium)
        if window is not None:
            self._window[worker] = window
            self._windowless.setdefault(worker, set()).update(hashes)
            return
        bit = TIER_BITS.get(medium)
        if bit is None:
            return
        owned = self._exact_by_worker.setdefault(worker, set())
        approx = self._approx_by_worker.get(worker)
        for h in hashes:
            holders = self._exact.setdefault(h, {})
            old = holders.get(worker, 0)
            holders[worker] = old | bit
            self._count_lower(old, old | bit)
            owned.add(h)
            if approx is not None and h in approx:  # confirmed: the event is the truth now
                self._drop_approx(worker, h)

    def remove(self, worker: str, hashes: Iterable[int], medium: str = MEDIUM_DEVICE) -> None:
        marks = self._windowless.get(worker)
        if marks and (medium == MEDIUM_DEVICE or medium_window(medium) is not None):
            hashes = list(hashes)  # a block leaving the device takes its window-less mark
            marks.difference_update(hashes)
        bit = TIER_BITS.get(medium)
        if bit is None:
            return
        owned = self._exact_by_worker.get(worker)
        approx = self._approx_by_worker.get(worker)
        for h in hashes:
            if approx is not None and h in approx:
                self._drop_approx(worker, h)
            holders = self._exact.get(h)
            if holders is None or worker not in holders:
                continue
            old = holders[worker]
            new = old & ~bit
            self._count_lower(old, new)
            if new:
                holders[worker] = new
                continue
            del holders[worker]
            if not holders:
                del self._exact[h]
            if owned is not None:
                owned.discard(h)

    def clear_worker(self, worker: str) -> None:
        """Forget everything about ``worker`` (it died, restarted or cleared its cache)."""
        for h in self._exact_by_worker.pop(worker, ()):
            holders = self._exact[h]
            self._count_lower(holders.pop(worker), 0)
            if not holders:
                del self._exact[h]
        for h in list(self._approx_by_worker.get(worker, ())):
            self._drop_approx(worker, h)
        self._approx_by_worker.pop(worker, None)
        self._windowless.pop(worker, None)
        self._window.pop(worker, None)

    def _count_lower(self, old: int, new: int) -> None:
        self.lower_tier_entries += (new > 1) - (old > 1)

    # ------------------------------------------------------------------ approximate (routing)
    def insert_approx(self, worker: str, hashes: Sequence[int], expiry: float) -> None:
        exact = self._exact
        mine = self._approx_by_worker.setdefault(worker, set())
        for h in hashes:
            holders = exact.get(h)
            if holders is not None and worker in holders:
                continue
            self._approx.setdefault(h, {})[worker] = expiry
            mine.add(h)
            self._expiries.append((expiry, h, worker))

    def _drop_approx(self, worker: str, h: int) -> None:
        holders = self._approx.get(h)
        if holders is not None and holders.pop(worker, None) is not None and not holders:
            del self._approx[h]
        mine = self._approx_by_worker.get(worker)
        if mine is not None:
            mine.discard(h)

    def sweep(self, now: float, budget: int = 1024) -> int:
        """Free up to ``budget`` expired approximate entries; return how many were freed."""
        freed = 0
        while self._expiries and self._expiries[0][0] <= now and freed < budget:
            _, h, worker = self._expiries.popleft()
            holders = self._approx.get(h)
            expiry = holders.get(worker) if holders is not None else None
            if expiry is not None and expiry <= now:  # not refreshed since
                self._drop_approx(worker, h)
                freed += 1
        return freed

    # ------------------------------------------------------------------ lookups
    def _holds(self, worker: str, h: int, now: float) -> bool:
        holders = self._exact.get(h)
        if holders is not None and worker in holders:
            return True
        approx = self._approx.get(h)
        return approx is not None and approx.get(worker, -1.0) > now

    def _any_holder(self, h: int, now: float) -> bool:
        if h in self._exact:
            return True
        approx = self._approx.get(h)
        if approx is None:
            return False
        return any(expiry > now for expiry in approx.values())

    def deepest(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks some worker holds."""
        depth = 0
        for h in hashes:
            if not self._any_holder(h, now):
                break
            depth += 1
        return depth

    def candidates(
        self, hashes: Sequence[int], depth: int, now: float, limit: int, rng: Random | None = None
    ) -> dict[str, int]:
        """Up to ``limit`` workers holding a prefix, deepest first: ``{worker: blocks}``.

        Where a level has more new holders than room (a popular system prompt held by much of
        the fleet), ``rng`` draws the ones taken: always the first-registered holders would
        make them hot spots while other holders of the same prefix idle. Without ``rng``,
        the first ones found."""
        found: dict[str, int] = {}
        for level in range(depth - 1, -1, -1):
            h = hashes[level]
            new = [w for w in self._exact.get(h, ()) if w not in found]
            approx = self._approx.get(h)
            if approx:
                seen = found.keys() | new
                new += [w for w, e in approx.items() if e > now and w not in seen]
            room = limit - len(found)
            if len(new) > room:
                new = rng.sample(new, room) if rng is not None else new[:room]
            for worker in new:
                found[worker] = level + 1
            if len(found) >= limit:
                return found
        return found

    def depth_of(self, worker: str, hashes: Sequence[int], depth: int, now: float) -> int:
        """How many leading blocks ``worker`` holds (at most ``depth``), by binary search:
        a worker holding a block holds its whole prefix."""
        lo, hi = 0, depth
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._holds(worker, hashes[mid - 1], now):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def resumable(self, worker: str, hashes: Sequence[int], blocks: int, block_size: int) -> int:
        """Of the first ``blocks`` blocks of a prompt that ``worker`` holds, how many it can
        resume from: the match cut back where a window-less block overlaps the ``W - 1``
        tokens before its end (``block_size`` tokens per block)."""
        marks = self._windowless.get(worker)
        if not marks:
            return blocks
        reach = -(-(self._window[worker] - 1) // block_size)  # blocks in the W - 1 tokens
        end, j = blocks, blocks - 1
        while j >= 0 and j >= end - reach:
            if hashes[j] in marks:
                end = j
            j -= 1
        return end

    def tier_mask(self, worker: str, h: int) -> int:
        """The tiers an exact entry says ``worker`` holds ``h`` on (0: none known)."""
        holders = self._exact.get(h)
        return holders.get(worker, 0) if holders is not None else 0

    def size(self) -> tuple[int, int]:
        """(exact entries, approximate entries)."""
        exact = sum(len(s) for s in self._exact_by_worker.values())
        approx = sum(len(s) for s in self._approx_by_worker.values())
        return exact, approx
