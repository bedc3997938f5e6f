"""HostTree: the host side of the tiered radix tree (``TieredRadixCache`` builds on it).

Nodes are ``TieredNode``s: besides the device slots of ``RadixCache`` (``value``, None once
the node left the device) they carry host slots (``host_value``, None when not on the host)
and, once computed, their chained storage keys. This class keeps what concerns the nodes
that are on the host only: their count (``_host_size`` counts every token with a host copy),
the host-evictable leaves (off the device, no children) in a ``LeafHeap`` of the same policy
as the device's, their deletion (``evict_host``), and pages fetched from storage hung below a
cached prefix (``attach_host``). ``_event`` emits the KV events of tier moves, each with the
medium it concerns.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.cache.allocator import PagedAllocator
from radixserve.cache.base import TokenIds, as_token_array
from radixserve.cache.events import (
    MEDIUM_HOST,
    BlockRemoved,
    BlockStored,
    KVEventQueue,
)
from radixserve.cache.eviction import LeafHeap
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.radix_cache import RadixCache, TreeNode
from radixserve.cache.tier_stats import TierStats


class TieredNode(TreeNode):
    __slots__ = ("host_value", "storage_keys")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.host_value: torch.Tensor | None = None  # host slots, or None: not on the host
        self.storage_keys: list[bytes] | None = None  # chained page keys, computed on need


class HostTree(RadixCache):
    node_class = TieredNode

    def __init__(self, allocator: PagedAllocator, host: HostKVPool, eviction_policy: str = "lru",
                 event_queue: KVEventQueue | None = None,
                 event_block_size: int | None = None,
                 cache_threshold: float | None = None):  # fmt: skip
        if host.page_size != allocator.page_size:
            raise ValueError("the host pool and the device pool must use the same page size")
        super().__init__(allocator, eviction_policy, event_queue, event_block_size, cache_threshold)
        self.host = host
        self._host_heap = LeafHeap(self._heap.policy, self._heap.clock)
        self._host_leaves: set[TieredNode] = set()
        self._host_size = 0  # tokens with a host copy
        self.tiers = TierStats(host_capacity_tokens=host.num_slots,
                               host_bytes_per_token=host.page_nbytes // host.page_size)  # fmt: skip

    def _split_payload(self, mid: TieredNode, child: TieredNode, n: int) -> None:
        if child.value is not None:
            super()._split_payload(mid, child, n)
        if child.host_value is not None:
            mid.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        if child.storage_keys is not None:
            keys, cut = child.storage_keys, n // self.page_size
            mid.storage_keys, child.storage_keys = keys[:cut], keys[cut:]

    def _touch(self, node: TreeNode | None) -> None:
        super()._touch(node)
        if node in self._host_leaves:
            self._host_heap.push(node)
            self._host_heap.maybe_compact(self._host_leaves, len(self._host_leaves))

    def _event(self, kind: type, node: TreeNode, medium: str) -> None:
        """Announce that ``node``'s blocks moved onto (BlockStored) or off (BlockRemoved)
        ``medium``, under the block hashes the node already holds (nothing is hashed again)."""
        if self.events is None:
            return
        if kind is BlockRemoved:
            if node.page_hashes:
                self._emit(BlockRemoved(node.page_hashes, node.namespace, medium))
            return
        self._emit(self._hasher.stored(node, medium))

    def _mark_host_leaf(self, node: TieredNode) -> None:
        self._host_leaves.add(node)
        self._host_heap.push(node)

    def _delete_host_leaf(self, leaf: TieredNode) -> int:
        parent = leaf.parent
        size = len(leaf.key)
        self.host.free(leaf.host_value)
        self._host_size -= size
        self._host_leaves.discard(leaf)
        del parent.children[self._child_key(leaf.key)]
        self.tiers.host_evicted_tokens += size
        self._event(BlockRemoved, leaf, MEDIUM_HOST)
        if parent.parent is None:
            if not parent.children and parent.namespace is not None:
                del self._roots[parent.namespace]
        elif parent.value is None and not parent.children:
            self._mark_host_leaf(parent)
        return size

    def _delete_host_subtree(self, node: TieredNode) -> None:
        for child in list(node.children.values()):
            self._delete_host_subtree(child)
        self._host_leaves.add(node)  # a leaf now, whatever the heap says
        self._delete_host_leaf(node)

    def evict_host(self, num_tokens: int) -> int:
        """Delete host-only leaves, lowest priority first, until ``num_tokens`` are freed."""
        freed = 0
        while freed < num_tokens:
            leaf = self._host_heap.pop(self._host_leaves.__contains__)
            if leaf is None:
                break
            freed += self._delete_host_leaf(leaf)
        return freed

    def attach_host(
        self, token_ids: TokenIds, extra_key: Any, start: int, host_slots: torch.Tensor,
        keys: list[bytes],
    ) -> int:  # fmt: skip
        """Hang pages fetched into ``host_slots`` (tokens ``[start, start + len)``) below the
        cached prefix ``[0, start)``; the tree takes the new ones, the rest are freed. Returns
        the tokens added (0 if the prefix is no longer cached)."""
        key = as_token_array(token_ids)[: start + len(host_slots)]
        match = self.match_prefix(key, extra_key, record_stats=False)
        pos = match.total_len
        if pos < start or pos == len(key):
            self.host.free(host_slots)
            return 0
        self.host.free(host_slots[: pos - start])  # cached meanwhile: duplicates
        parent = match.lower_handle or match.handle or self._root(extra_key)
        leaf = self._new_node(parent, key[pos:].copy(), None, parent.namespace)
        leaf.host_value = host_slots[pos - start :].to(torch.int64, copy=True)
        leaf.storage_keys = keys[(pos - start) // self.page_size :]
        leaf.last_access = self._clock
        parent.children[self._child_key(leaf.key)] = leaf
        if self.events is not None:
            self._hasher.hash_node(leaf)  # a new node: its blocks are named here
        self._event(BlockStored, leaf, MEDIUM_HOST)
        self._host_size += len(leaf.key)
        self._host_leaves.discard(parent)
        self._mark_host_leaf(leaf)
        return len(leaf.key)

    def host_size(self) -> int:
        return self._host_size
