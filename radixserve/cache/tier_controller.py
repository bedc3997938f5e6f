"""TierController: the one owner of every KV move between the device pool (L1), the host
pool (L2) and a storage tier (L3), with their queues and acknowledgements.

The radix tree (``radix_cache.py``) records where each node's KV lives; this controller
decides and performs the copies, then tells the tree (``set_host``, ``set_device``,
``attach_host``: ``host_nodes.py``). It listens to the tree (``tree_listener.py``, last in
order): a node was cached, was hit, is about to leave the device, was deleted from the host
(its host slots are freed here). The engine holds it directly, as its ``LowerTiers``
(``lower_tiers.py``: ``load_back``, ``start_prefetch``, ``poll``, ``stats``, ...). Storage I/O
runs on ``storage_io.StorageIO``'s threads, which this controller alone drives and polls.

Write policies, i.e. when a node's KV is copied to the host:

- ``write_through``: as soon as it enters the tree (every computed page);
- ``write_through_selective`` (default): once it is reused (``on_hit``; with the insert
  counted as its first hit, this is its second);
- ``write_back``: only when it is evicted from the device.

A device leaf with host-only children is copied before it leaves whatever the policy (else
they would hang below nothing), or, with the host full, deleted with them.

``load_back`` copies a match's host part to freshly allocated device slots, only from
``load_back_min_tokens`` tokens up: all of it, or, when the device pool cannot make room for
all (running requests hold it), its longest leading part that fits, so a full pool still
saves what it can. Storage keeps KV in blocks of a fixed number of tokens (64 by default,
whatever the page size), keyed by chained hashes from the root: when a node is copied to the
host, the blocks whose last token is in it are written out; ``start_prefetch`` asks storage
for the blocks past a waiting request's cached prefix, and ``poll`` hangs what arrived below
that prefix. A block already stored is not written again, whatever it holds.

Sliding-window layers kept apart (``window_tree.py``): a block is stored with their KV only
when every token in it has that KV in its host copy, else with the global layers only
(``storage.page_format`` explains the choice); blocks read back hang as host nodes whose
``host_window`` says what was stored, so a match never resumes where the window before it
would come from a block without it. A tree that keeps every layer in one pool takes the
leading blocks with window KV only (another instance sharing the store may have written
blocks without it).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time

import numpy as np
import torch

from radixserve.cache.base import EMPTY_INDICES, MatchResult, Namespace, TokenIds, as_token_array
from radixserve.cache.events import MEDIUM_STORAGE
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.radix_cache import RadixCache, TreeNode
from radixserve.cache.storage import (
    ClearResult,
    PageLayout,
    StorageScope,
    chain_page_keys,
    open_backend,
)
from radixserve.cache.storage_io import Fetched, Prefetch, StorageIO
from radixserve.cache.tier_stats import TierStats
from radixserve.cache.tree_check import check_host_tier
from radixserve.cache.tree_listener import TreeListener

WRITE_POLICIES = ("write_through_selective", "write_through", "write_back")
SELECTIVE_MIN_HITS = 1  # write_through_selective copies a node once it was hit this often
LOOKUP_WAIT_S = 0.005  # how long a step's start waits for storage lookups still out


class TierController(TreeListener):
    order = 2  # last: a copy reads what the other listeners set

    def __init__(self, tree: RadixCache, host: HostKVPool,
                 write_policy: str = "write_through_selective",
                 load_back_min_tokens: int = 1):  # fmt: skip
        """Below ``tree`` (an empty one), with ``host`` as its host pool."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"unknown write policy {write_policy!r}; choose one of {WRITE_POLICIES}"
            )
        if host.page_size != tree.page_size:
            raise ValueError("the host pool and the device pool must use the same page size")
        self.tree, self.host, self.page_size = tree, host, tree.page_size
        self.write_policy = write_policy
        self.load_back_min_tokens = load_back_min_tokens
        self.tiers = TierStats(write_policy=write_policy, host_capacity_tokens=host.num_slots,
                               host_bytes_per_token=host.page_nbytes // host.page_size)  # fmt: skip
        self.storage: StorageIO | None = None
        self._scope: StorageScope | None = None
        if tree.total_size() or tree.host_size():
            raise RuntimeError("lower tiers are attached to an empty tree only")
        tree.add_listener(self)

    # ------------------------------------------------------------------ what the tree tells
    def on_cached(self, node: TreeNode) -> None:
        if self.write_policy == "write_through":
            self.backup(node)

    def on_hit(self, node: TreeNode | None) -> None:
        if self.write_policy != "write_through_selective":
            return
        while node is not None and node.parent is not None:
            if node.host_value is None and node.hit_count >= SELECTIVE_MIN_HITS:
                self.backup(node)
            node = node.parent

    def before_evict(self, node: TreeNode) -> None:
        if self.write_policy == "write_back" or node.children:
            self.backup(node)

    def on_host_removed(self, node: TreeNode) -> None:
        self.host.free(node.host_value)

    def check(self, held: torch.Tensor | None) -> None:
        """The tree's host side (``check_host_tier``) and the host pool: free + cached +
        held by storage I/O == capacity."""
        host_slots = check_host_tier(self.tree, self.tree.integrity_state())
        io = self.storage.held_host_slots() if self.storage is not None else EMPTY_INDICES
        self.host.check(host_slots, io)

    # ------------------------------------------------------------------ device <-> host
    def alloc_host(self, n: int) -> torch.Tensor | None:
        """``n`` host slots, evicting host-only leaves when short; None if impossible."""
        slots = self.host.alloc(n)
        if slots is None:
            self.tree.evict_host(n - self.host.allocator.free_size())
            slots = self.host.alloc(n)
        return slots

    def backup(self, node: TreeNode) -> bool:
        """Copy a device node's KV to the host (making host room if needed), then to storage."""
        slots = self.alloc_host(len(node.key))
        if slots is None:
            self.tiers.backup_failures += 1
            return False
        start = time.perf_counter()
        self.host.backup(node.value, slots)
        self.tiers.backup_seconds += time.perf_counter() - start
        self.tree.set_host(node, slots)
        if self.storage is not None:
            self._write_out(node)
        return True

    def _alloc_device(self, n: int) -> torch.Tensor | None:
        slots = self.tree.allocator.alloc(n)
        if slots is None:
            self.tree.make_room(n)
            slots = self.tree.allocator.alloc(n)
        return slots

    def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the host part of ``match`` onto the device: all of it, or, when the device
        cannot make room for all, its longest leading part that fits (a partial load); the
        match it became, or ``match`` itself when what fits is under the minimum."""
        if match.host_len == 0 or match.host_len < self.load_back_min_tokens:
            return match
        with self.tree.pinned(match):
            n, windowed = self._load_size(match.host_len)
            if n >= max(self.load_back_min_tokens, 1):
                slots = self._alloc_load(n, windowed)
            else:
                slots = None
        if slots is None:
            self.tiers.load_failures += 1
            return match
        head = n - windowed  # loaded as tombstones: the global layers only
        nodes = self._host_path(match, n, head)
        start = time.perf_counter()
        try:
            self.host.restore(torch.cat([node.host_value for node in nodes]), slots, head)
        except BaseException:
            self.tree.allocator.free(slots)
            raise
        offset = 0
        for node in nodes:
            window = node.host_window and offset >= head
            self.tree.set_device(node, slots[offset : offset + len(node.key)], window)
            offset += len(node.key)
        self.tiers.loads += 1
        self.tiers.partial_loads += n < match.host_len
        self.tiers.load_latency.observe(time.perf_counter() - start)
        return self.tree.resumable(MatchResult(
            device_indices=torch.cat([match.device_indices, slots]),
            handle=nodes[-1],
            device_len=match.device_len + n,
            host_len=match.host_len - n,
            storage_len=match.storage_len,
            lower_handle=match.lower_handle if n < match.host_len else None,
        ))  # fmt: skip

    def _load_size(self, host_len: int) -> tuple[int, int]:
        """How many host tokens a load brings (whole pages, as many as the device has room
        for), and how many of them, at its end, with window pages: with window layers apart,
        as many as the window pool has room for. Only the window before the load's end needs
        them (where the request resumes), so when the window pool is short the tokens before
        are loaded as tombstones, and it does not bound the load."""
        page = self.page_size
        main, window = self.tree.obtainable()
        n = min(host_len, main - main % page)
        if window is None:
            return n, n
        windowed = min(n, window - window % page)
        if windowed < min(n, self.tree.allocator.window_span):
            return windowed, windowed  # no room for the window before the end: load less
        return n, windowed

    def _alloc_load(self, n: int, windowed: int) -> torch.Tensor | None:
        """Device slots for a load of ``n`` tokens, the last ``windowed`` with window pages."""
        allocator = self.tree.allocator
        if windowed == n:
            return self._alloc_device(n)
        self.tree.make_room(n, windowed)
        head = allocator.alloc_without_windows(n - windowed)
        tail = allocator.alloc(windowed) if head is not None else None
        if tail is None:
            if head is not None:
                allocator.free(head)
            return None
        return torch.cat([head, tail])

    def _host_path(self, match: MatchResult, n: int, head: int = 0) -> list[TreeNode]:
        """The nodes holding the first ``n`` tokens of ``match``'s host part, from the top,
        split so that one ends exactly at token ``head`` and the last at token ``n``."""
        nodes: list[TreeNode] = []
        node = match.lower_handle
        while node is not match.handle:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        for at in (head, n):
            nodes = self._cut(nodes, at)
        ends = list(itertools.accumulate(len(node.key) for node in nodes))
        return nodes[: bisect.bisect_left(ends, n) + 1]

    def _cut(self, nodes: list[TreeNode], at: int) -> list[TreeNode]:
        """``nodes`` (a path from the top) with the one holding token ``at`` split there."""
        pos = 0
        for k, node in enumerate(nodes):
            if pos < at < pos + len(node.key):
                upper = self.tree.split(node, at - pos)
                return [*nodes[:k], upper, node, *nodes[k + 1 :]]
            pos += len(node.key)
        return nodes

    # ------------------------------------------------------------------ host <-> storage
    def attach_storage(self, url: str, model_id: str, capacity_bytes: int | None,
                       min_tokens: int, timeout: float,
                       block_tokens: int = 64) -> StorageIO:  # fmt: skip
        """Open the backend for ``url`` below the host tier, storing blocks of
        ``block_tokens`` rounded up to whole pages. At most a quarter of the host pool waits
        for write-outs at any time."""
        block = -(-block_tokens // self.page_size) * self.page_size
        self._scope = StorageScope(
            model_id, PageLayout.from_shape(self.host.device_pool.shape, block)
        )
        backend = open_backend(url, self._scope, capacity_bytes)
        max_pending = max(block // self.page_size, self.host.allocator.num_pages // 4)
        self.storage = StorageIO(self.host, backend, self.tiers, self.alloc_host, block,
                                 min_tokens, timeout, max_pending)  # fmt: skip
        self.tiers.storage_url = url
        return self.storage

    def _write_out(self, node: TreeNode) -> None:
        """Write to storage the blocks whose last token is in ``node`` (just copied to the
        host), keys chained from the root. A block reaching above the node is written only
        when the nodes it reaches into have host copies too."""
        b = self.storage.block_tokens
        end = node.depth
        start = end - len(node.key)
        lo, hi = start // b * b, end // b * b
        if lo >= hi:
            return
        path = self._path_to(node, lo)
        if path is None:  # the first block reaches above into KV the host lacks
            lo += b
            if lo >= hi:
                return
            path = self._path_to(node, lo)
        tokens, slots, window = path
        keys = chain_page_keys(self._scope, None, tokens[:hi], node.namespace)[lo // b :]
        windows = window[: hi - lo].reshape(-1, b).all(axis=1).tolist()  # one flag a block
        self.storage.write(keys, slots[: hi - lo], windows, self._on_stored(node, lo))

    @staticmethod
    def _path_to(node: TreeNode, lo: int) -> tuple[np.ndarray, torch.Tensor, np.ndarray] | None:
        """Every token from the root to the end of ``node``, and the host slots of those from
        ``lo`` on with whether each host copy has the window layers' KV (None: a node there
        has no host copy)."""
        keys, slots, window, n = [], [], [], node
        while n.parent is not None:
            keys.append(n.key)
            if n.depth > lo:
                if n.host_value is None:
                    return None
                cut = max(0, lo - (n.depth - len(n.key)))
                slots.append(n.host_value[cut:])
                window.append(np.full(len(n.key) - cut, n.host_window))
            n = n.parent
        return np.concatenate(keys[::-1]), torch.cat(slots[::-1]), np.concatenate(window[::-1])

    def _on_stored(self, node: TreeNode, lo: int):
        """A callback that reports (as KV events) the node's event blocks that lie in storage
        once the first ``n`` storage blocks from token ``lo`` are there."""
        feed = self.tree.event_feed
        whole = feed.stored(node, MEDIUM_STORAGE)
        if whole is None:
            return None
        offset, block = node.offset, feed.block_size
        storage_block = self.storage.block_tokens

        def emit(blocks: int) -> None:
            # the node's event blocks that end inside its first ``blocks`` storage blocks
            stored_end = min(lo + blocks * storage_block, offset + len(node.key))
            count = stored_end // block - offset // block
            if count > 0:  # dropped by the tree if events went off meanwhile
                feed.emit(dataclasses.replace(
                    whole, block_hashes=whole.block_hashes[:count],
                    token_ids=whole.token_ids[: count * block],
                ))  # fmt: skip

        return emit

    def start_prefetch(self, token_ids: TokenIds, namespace: Namespace = None) -> Prefetch | None:
        """Ask storage for the blocks past the cached prefix of a waiting request (None:
        fewer than the minimum to fetch, no storage, or a store that stopped answering)."""
        if self.storage is None:
            return None
        b = self.storage.block_tokens
        key = as_token_array(token_ids)
        cached = self.tree.peek_prefix(key, namespace).length
        end = len(key) // b * b
        if end - cached < self.storage.min_tokens or self.storage.stalled():
            return None
        lo = cached // b * b  # the block holding the first missing token
        keys = chain_page_keys(self._scope, None, key[:end], namespace)[lo // b :]
        return self.storage.lookup(key[:end].copy(), namespace, lo, keys)

    def poll(self, timeout: float = 0.0) -> None:
        """Apply finished storage transfers (waiting up to ``timeout`` s for one). Lookups
        still out (requests that arrived since the last step) are awaited up to
        ``LOOKUP_WAIT_S``: a store answers them in microseconds (a file index) to a
        millisecond (a network store), so a request whose pages storage lacks is admitted in
        this step instead of one step later, and a fetch starts a step sooner."""
        if self.storage is None:
            return
        fetched = self.storage.poll(timeout)
        start = time.monotonic()
        while self.storage.lookups_in_flight() and not self.storage.stalled():
            left = start + LOOKUP_WAIT_S - time.monotonic()
            if left <= 0:
                break
            fetched += self.storage.poll(left)
        self.tiers.lookup_wait_seconds += time.monotonic() - start
        self._attach(fetched)

    def attach_host(self, token_ids: TokenIds, namespace: Namespace, start: int,
                    host_slots: torch.Tensor, window: np.ndarray | None = None) -> int:  # fmt: skip
        """Hang pages read into ``host_slots`` below the cached prefix ``[0, start)``
        (``RadixCache.attach_host``), freeing the slots the tree let go; the tokens added."""
        added, unused = self.tree.attach_host(token_ids, namespace, start, host_slots, window)
        self.host.free(unused)
        return added

    def _attach(self, fetched: list[Fetched]) -> None:
        b = self.storage.block_tokens
        for f in fetched:
            windows = f.windows
            if not self.tree.allocator.windowed and not all(windows):  # one pool: full blocks
                windows = windows[: windows.index(False)]
            p, got = f.prefetch, len(windows) * b
            if got:
                tokens, slots = p.token_ids[: p.start + got], f.host_slots[:got]
                window = np.repeat(np.array(windows, dtype=bool), b)
                added = self.attach_host(tokens, p.namespace, p.start, slots, window)
                p.fetched = (p.start + got - added, p.start + got)
            self.host.free(f.host_slots[got:])

    # ------------------------------------------------------------------ interface
    def stats(self) -> TierStats:
        t, moved = self.tiers, self.host.stats
        t.host_cached_tokens = self.tree.host_size()
        t.pages_to_host, t.bytes_to_host = moved.pages_to_host, moved.bytes_to_host
        t.pages_to_device, t.bytes_to_device = moved.pages_to_device, moved.bytes_to_device
        if self.storage is not None:
            t.storage = self.storage.backend.stats()
            t.prefetches_in_flight = self.storage.reads_in_flight()
        return t.snapshot()

    def clear_storage(self) -> ClearResult | None:
        if self.storage is None:
            return None
        fetched, result = self.storage.clear()
        self._attach(fetched)
        return result

    def close(self) -> None:
        if self.storage is not None:
            self._attach(self.storage.close())
