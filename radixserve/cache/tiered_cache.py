"""TieredRadixCache: the radix tree over the device pool (L1) and a host pool (L2), with an
optional storage tier below (L3, ``storage_tier.StorageTier``). The host-only nodes' own
bookkeeping is in ``host_tree.HostTree``; this module moves KV between the tiers.

A node holds its tokens' KV on the device (``value``: slots), on the host (``host_value``), or
on both. Invariants (``check_integrity``, after every test step):

- every node is on the device or the host; the device nodes are closed under ancestors, so
  off-device nodes form the tail of every path and a match is one contiguous prefix: device
  part, then host part;
- locks, the evictable/protected sizes and the device-leaf heap concern device tokens only,
  exactly as in ``RadixCache`` (a device leaf: nothing below it is on the device);
- host eviction takes only nodes off the device with no children, and deletes them;
- each pool: free + cached + held == capacity (host pages under storage I/O count as held).

Write policies, i.e. when a node's KV is copied to the host:

- ``write_through``: as soon as it enters the tree (every computed page);
- ``write_through_selective`` (default): once it is reused (``record_hit``; with the insert
  counted as its first hit, this is its second);
- ``write_back``: only when it is evicted from the device.

A device leaf that is evicted keeps its node when it has a host copy (BlockRemoved, medium
device); without one it is deleted as in ``RadixCache``. A device leaf with host-only children
is copied first whatever the policy (else they would hang below nothing), or, with the host
full, deleted with them. ``load_back`` copies a match's host part to freshly allocated device
slots, all or nothing, and only from ``load_back_min_tokens`` tokens up. ``reset`` empties
both pools of everything unlocked.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from radixserve.cache.allocator import PagedAllocator
from radixserve.cache.base import EMPTY_INDICES, MatchResult, TokenIds
from radixserve.cache.events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventQueue,
)
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.host_tree import HostTree, TieredNode
from radixserve.cache.radix_cache import TreeNode
from radixserve.cache.storage import ClearResult
from radixserve.cache.tier_stats import TierStats
from radixserve.cache.tree_check import check_host_tier

WRITE_POLICIES = ("write_through_selective", "write_through", "write_back")
SELECTIVE_MIN_HITS = 1  # write_through_selective copies a node once it was hit this often


class TieredRadixCache(HostTree):
    def __init__(
        self,
        allocator: PagedAllocator,
        host: HostKVPool,
        write_policy: str = "write_through_selective",
        eviction_policy: str = "lru",
        event_queue: KVEventQueue | None = None,
        load_back_min_tokens: int = 1,
        event_block_size: int | None = None,
        cache_threshold: float | None = None,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"unknown write policy {write_policy!r}; choose one of {WRITE_POLICIES}"
            )
        super().__init__(
            allocator, host, eviction_policy, event_queue, event_block_size, cache_threshold
        )
        self.write_policy = self.tiers.write_policy = write_policy
        self.load_back_min_tokens = load_back_min_tokens
        self.storage: Any = None  # a StorageTier, attached by storage_tier.attach_storage
        self._flushing = False

    # ------------------------------------------------------------------ RadixCache hooks
    def _is_leaf(self, node: TreeNode) -> bool:
        return all(c.value is None for c in node.children.values())

    def _reuse(self, node: TieredNode, indices: torch.Tensor) -> bool:
        if node.value is not None:
            return True
        self._to_device(node, indices.to(torch.int64, copy=True))  # recomputed: take its slots
        return False

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, value: torch.Tensor) -> TreeNode:
        leaf = super()._add_leaf(parent, key, value)
        if self.write_policy == "write_through":
            self._backup(leaf)
        return leaf

    def _match_result(self, path: list[TreeNode], last: TreeNode | None) -> MatchResult:
        k = 0
        while k < len(path) and path[k].value is not None:
            k += 1
        handle = path[k - 1] if k else (path[0].parent if path else last)
        result = super()._match_result(path[:k], handle)
        if k < len(path):
            result.host_len = sum(len(n.key) for n in path[k:])
            result.lower_handle = path[-1]
        return result

    def record_hit(self, node: TreeNode | None, lookup_tokens: int, hit_tokens: int,
                   host_tokens: int = 0, storage_tokens: int = 0) -> None:  # fmt: skip
        super().record_hit(node, lookup_tokens, hit_tokens, host_tokens, storage_tokens)
        if self.write_policy != "write_through_selective":
            return
        while node is not None and node.parent is not None:
            if node.host_value is None and node.hit_count >= SELECTIVE_MIN_HITS:
                self._backup(node)
            node = node.parent

    def _remove_leaf(self, node: TieredNode) -> int:
        """Evict a device leaf: keep it on the host if it has (or can get) a host copy."""
        if node.host_value is None and not self._flushing:
            if self.write_policy == "write_back" or node.children:
                self._backup(node)
        if node.host_value is None:
            for child in list(node.children.values()):
                self._delete_host_subtree(child)  # nothing to hang below: drop them
            return super()._remove_leaf(node)
        size = len(node.key)
        self.allocator.free(node.value)
        node.value = None
        self._evictable_leaves.discard(node)
        self._evictable_size -= size
        self.stats.evicted_tokens += size
        self.stats.evictions += 1
        self._event(BlockRemoved, node, MEDIUM_DEVICE)
        if not node.children:
            self._mark_host_leaf(node)
        parent = node.parent
        if parent.parent is not None and parent.lock_ref == 0 and self._is_leaf(parent):
            self._mark_leaf(parent)
        return size

    # ------------------------------------------------------------------ tier moves
    def _backup(self, node: TieredNode) -> bool:
        """Copy a device node's KV to the host (making host room if needed)."""
        n = len(node.key)
        slots = self.host.alloc(n)
        if slots is None:
            self.evict_host(n - self.host.allocator.free_size())
            slots = self.host.alloc(n)
        if slots is None:
            self.tiers.backup_failures += 1
            return False
        self.host.backup(node.value, slots)
        node.host_value = slots
        self._host_size += n
        self._event(BlockStored, node, MEDIUM_HOST)
        if self.storage is not None:
            self.storage.write(self._storage_keys(node), slots, self._on_stored(node))
        return True

    def _on_stored(self, node: TieredNode):
        """A callback that reports the node's first pages written to storage (KV events)."""
        if self.events is None:
            return None
        whole = self._hasher.stored(node, MEDIUM_STORAGE)
        if whole is None:
            return None
        offset, block = node.offset, self._hasher.block_size

        def emit(pages: int) -> None:
            # the node's blocks that end inside its first ``pages`` pages are all in storage
            count = (offset + pages * self.page_size) // block - offset // block
            if count > 0:  # dropped if events went off since the write began
                self._emit(dataclasses.replace(
                    whole, block_hashes=whole.block_hashes[:count],
                    token_ids=whole.token_ids[: count * block],
                ))  # fmt: skip

        return emit

    def node_medium(self, node: TreeNode) -> str:
        return MEDIUM_DEVICE if node.value is not None else MEDIUM_HOST

    def _to_device(self, node: TieredNode, slots: torch.Tensor) -> None:
        """An off-device node gets device slots (its KV is there, or about to be)."""
        node.value = slots
        self._host_leaves.discard(node)
        self._evictable_leaves.discard(node.parent)  # it has a device child now
        self._evictable_size += len(node.key)  # off-device nodes are never locked
        if self._is_leaf(node):
            self._mark_leaf(node)
        self._event(BlockStored, node, MEDIUM_DEVICE)

    def _alloc_device(self, n: int) -> torch.Tensor | None:
        slots = self.allocator.alloc(n)
        if slots is None:
            self.evict(n - self.allocator.free_size())
            slots = self.allocator.alloc(n)
        return slots

    def load_back(self, match: MatchResult) -> MatchResult:
        if match.host_len == 0 or match.host_len < self.load_back_min_tokens:
            return match
        nodes: list[TieredNode] = []
        node = match.lower_handle
        while node is not match.handle:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        # Making device room may copy device leaves to the host, which may evict host leaves:
        # lock the device part and hide the host part's leaf from host eviction meanwhile.
        hidden = match.lower_handle in self._host_leaves
        self._host_leaves.discard(match.lower_handle)
        self.inc_lock_ref(match.handle)
        try:
            slots = self._alloc_device(match.host_len)
        finally:
            self.dec_lock_ref(match.handle)
            if hidden:
                self._mark_host_leaf(match.lower_handle)
        if slots is None:
            self.tiers.load_failures += 1
            return match
        start = time.perf_counter()
        try:
            self.host.restore(torch.cat([n.host_value for n in nodes]), slots)
        except BaseException:
            self.allocator.free(slots)
            raise
        offset = 0
        for node in nodes:
            self._to_device(node, slots[offset : offset + len(node.key)])
            offset += len(node.key)
        self.tiers.loads += 1
        self.tiers.load_latency.observe(time.perf_counter() - start)
        return MatchResult(
            device_indices=torch.cat([match.device_indices, slots]),
            handle=nodes[-1],
            device_len=match.device_len + match.host_len,
            storage_len=match.storage_len,
        )

    def _storage_keys(self, node: TieredNode) -> list[bytes]:
        """The node's chained storage keys, computed (and kept) down from the nearest
        ancestor that has them."""
        chain = []
        n = node
        while n.parent is not None and n.storage_keys is None:
            chain.append(n)
            n = n.parent
        prev = n.storage_keys[-1] if n.parent is not None else None
        for n in reversed(chain):
            n.storage_keys = self.storage.page_keys(n.namespace, n.key, prev)
            prev = n.storage_keys[-1]
        return node.storage_keys

    # ------------------------------------------------------------------ interface
    def reset(self) -> int:
        self._flushing = True  # no copies to the host: everything goes
        try:
            freed = self.evict(self._evictable_size)
        finally:
            self._flushing = False
        freed += self.evict_host(self._host_size)
        if self.total_size() == 0 and self._host_size == 0:
            self._emit(AllBlocksCleared())
        return freed

    def tier_stats(self) -> TierStats:
        t, moved = self.tiers, self.host.stats
        t.host_cached_tokens = self._host_size
        t.pages_to_host, t.bytes_to_host = moved.pages_to_host, moved.bytes_to_host
        t.pages_to_device, t.bytes_to_device = moved.pages_to_device, moved.bytes_to_device
        if self.storage is not None:
            self.storage.fill_stats(t)
        return t.snapshot()

    def start_prefetch(self, token_ids: TokenIds, extra_key: Any = None) -> Any:
        return self.storage.start_prefetch(token_ids, extra_key) if self.storage else None

    def poll_transfers(self, timeout: float = 0.0) -> None:
        if self.storage is not None:
            self.storage.poll(timeout)

    def clear_storage(self) -> ClearResult | None:
        return None if self.storage is None else self.storage.clear()

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()

    def check_integrity(self, held_indices: torch.Tensor | None = None) -> None:
        super().check_integrity(held_indices)
        held = self.storage.held_host_slots() if self.storage is not None else EMPTY_INDICES
        check_host_tier(self, held)
