"""RadixCache: every computed prefix, stored once, in a radix tree of token ids -> KV slots.

Each node's edge is a run of token ids (whole pages when ``page_size > 1``) with the matching
run of slot indices; children are keyed by their first token (first page). Namespaces
(``extra_key``) get separate roots and never share nodes. The tree stores indices, never
tensors, and owns the slots of its nodes: it returns them to the allocator on eviction.

Sizes, kept in O(1):
- ``protected``: tokens in nodes with ``lock_ref > 0`` (read by running requests);
- ``evictable``: tokens in unlocked nodes. An unlocked node's subtree is unlocked too, so
  evicting leaves first, cascading to parents that become leaves, can free all of it.

Locks are taken along the whole path to the root, so ``lock_ref(node) >= sum of children's``.
Eviction pops the lowest-priority evictable leaf from a lazy heap (``eviction.LeafHeap``):
O(k log n) for k evicted leaves, never a walk of the tree.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixserve.cache.allocator import PagedAllocator
from radixserve.cache.base import (
    EMPTY_INDICES,
    CacheStats,
    MatchResult,
    PrefixCache,
    PrefixPeek,
    TokenIds,
    TreeSummary,
    as_token_array,
)
from radixserve.cache.events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    KVEventQueue,
    default_block_size,
)
from radixserve.cache.eviction import EvictionPolicy, LeafHeap, make_policy
from radixserve.cache.tree_check import check_tree, tree_summary
from radixserve.cache.tree_events import TreeEvents


class TreeNode:
    __slots__ = (
        "id",
        "parent",
        "children",
        "key",
        "value",
        "lock_ref",
        "last_access",
        "hit_count",
        "page_hashes",
        "offset",
        "namespace",
        "depth",
        "created",
        "policy_state",
    )

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        key: np.ndarray,
        value: torch.Tensor,
        namespace: Any = None,
    ):
        self.id = node_id
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.page_hashes: list[int] = []  # the KV-event blocks it owns (tree_events.py)
        self.offset = 0  # tokens above its edge, kept while events are on
        self.namespace = namespace
        self.depth = 0  # tokens from the root to the end of this edge
        self.created = 0  # the cache's admission count when this node was cached
        self.policy_state: Any = None  # the eviction policy's own (eviction.py)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache(PrefixCache):
    node_class: type[TreeNode] = TreeNode

    def __init__(
        self,
        allocator: PagedAllocator,
        eviction_policy: str | EvictionPolicy = "lru",
        event_queue: KVEventQueue | None = None,
        event_block_size: int | None = None,
        cache_threshold: float | None = None,
    ):
        self.allocator = allocator
        self.page_size = allocator.page_size
        if isinstance(eviction_policy, str):
            eviction_policy = make_policy(
                eviction_policy, cache_threshold, self.total_size, lambda: self._clock
            )
        self.eviction_policy = eviction_policy.name
        self.admissions = 0  # requests admitted (record_hit calls): the policies' clock
        self._heap = LeafHeap(eviction_policy, lambda: self.admissions)
        self.events: KVEventQueue | None = None  # set only while events are on
        self._hasher = TreeEvents(self, event_block_size or default_block_size(self.page_size))
        self.stats = CacheStats()
        self._next_id = 0
        self._clock = 0
        self._roots: dict[Any, TreeNode] = {}
        self._evictable_leaves: set[TreeNode] = set()
        self._evictable_size = 0
        self._protected_size = 0
        if event_queue is not None:
            self.events = event_queue  # an empty tree: nothing to snapshot

    # ------------------------------------------------------------------ events
    @property
    def event_block_size(self) -> int:
        return self._hasher.block_size

    def enable_events(self, queue: KVEventQueue) -> None:
        """Emit ``AllBlocksCleared`` and every cached block as stored (what a subscriber knew
        may be stale: events were off), then every change, to ``queue``."""
        self.events = queue
        queue.append(AllBlocksCleared())
        for event in self._hasher.snapshot():
            queue.append(event)

    def disable_events(self) -> None:
        """Stop hashing and emitting; hashes kept on nodes go stale and are redone on enable."""
        self.events = None

    def _emit(self, event: KVEvent | None) -> None:
        """Queue ``event`` while events are on, else drop it. ``self.events`` is the one
        on/off state: whatever emits later (a storage write-out's callback) comes through
        here, so a subscriber leaving in between costs an event, never a step."""
        if self.events is not None and event is not None:
            self.events.append(event)

    def snapshot_events(self) -> list[BlockStored]:
        """Every cached block as ``BlockStored`` events, parents first (a full dump)."""
        return self._hasher.snapshot()

    def node_medium(self, node: TreeNode) -> str:
        """The tier a node's KV is on, for its events (a tiered cache overrides this)."""
        return MEDIUM_DEVICE

    # ------------------------------------------------------------------ helpers
    def _new_node(
        self, parent: TreeNode | None, key: np.ndarray, value: torch.Tensor, namespace: Any = None
    ) -> TreeNode:
        self._next_id += 1
        return self.node_class(self._next_id, parent, key, value, namespace)

    def _root(self, extra_key: Any) -> TreeNode:
        root = self._roots.get(extra_key)
        if root is None:
            root = self._new_node(None, np.empty(0, np.int32), EMPTY_INDICES, extra_key)
            self._roots[extra_key] = root
        return root

    def _child_key(self, key: np.ndarray) -> Any:
        return int(key[0]) if self.page_size == 1 else key[: self.page_size].tobytes()

    def _match_len(self, edge: np.ndarray, key: np.ndarray) -> int:
        n = min(len(edge), len(key))
        if edge[:n].tobytes() == key[:n].tobytes():  # most edges on a path match whole
            return n - n % self.page_size
        differs = edge[:n] != key[:n]
        m = int(differs.argmax()) if differs.any() else n
        return m - m % self.page_size

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node in self._evictable_leaves

    def _mark_leaf(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node)
        self._heap.push(node)

    def _touch(self, node: TreeNode | None) -> None:
        self._clock += 1
        n = node
        while n is not None and n.parent is not None:
            n.last_access = self._clock
            n = n.parent
        if node is not None and node in self._evictable_leaves:
            self._heap.push(node)  # its priority changed; the old entry goes stale
            self._heap.maybe_compact(self._evictable_leaves, len(self._evictable_leaves))

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None
        mid = self._new_node(parent, child.key[:n], None, child.namespace)
        self._split_payload(mid, child, n)
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        mid.hit_count = child.hit_count
        mid.depth, mid.created = parent.depth + n, child.created
        mid.policy_state = child.policy_state
        if self.events is not None:
            self._hasher.split(mid, child, n)
        parent.children[self._child_key(mid.key)] = mid
        child.key, child.parent = child.key[n:], mid
        mid.children[self._child_key(child.key)] = child
        self._heap.note_split(mid, child)
        return mid

    def _split_payload(self, mid: TreeNode, child: TreeNode, n: int) -> None:
        """Cut what a node holds per token (its slot run) between ``mid`` and ``child``."""
        mid.value, child.value = child.value[:n], child.value[n:]

    def _is_leaf(self, node: TreeNode) -> bool:
        """Whether nothing below ``node`` holds device slots (so evicting it frees a leaf)."""
        return not node.children

    def _reuse(self, node: TreeNode, indices: torch.Tensor) -> bool:
        """``insert`` met ``node`` on its path: True if its KV is cached already (the caller's
        ``indices`` for it are duplicates); a tiered cache takes them instead when the node
        has left the device, and answers False."""
        return True

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, value: torch.Tensor) -> TreeNode:
        leaf = self._new_node(parent, key, value, parent.namespace)
        leaf.depth, leaf.created = parent.depth + len(key), self.admissions
        parent.children[self._child_key(key)] = leaf
        self._evictable_leaves.discard(parent)
        self._evictable_size += len(key)
        self._clock += 1
        leaf.last_access = self._clock
        self._mark_leaf(leaf)
        if self.events is not None:
            self._emit(self._hasher.hash_node(leaf))
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> int:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        self.allocator.free(leaf.value)
        del parent.children[self._child_key(leaf.key)]
        self._evictable_leaves.discard(leaf)
        size = len(leaf.key)
        self._evictable_size -= size
        self.stats.evicted_tokens += size
        self.stats.evictions += 1
        if self.events is not None:
            self._emit(self._hasher.removed(leaf))
        if parent.parent is not None:
            if parent.lock_ref == 0 and self._is_leaf(parent):
                self._mark_leaf(parent)
        elif not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # an empty namespace leaves no trace
        return size

    # ------------------------------------------------------------------ interface
    def match_prefix(
        self, token_ids: TokenIds, extra_key: Any = None, record_stats: bool = True
    ) -> MatchResult:
        key = as_token_array(token_ids)
        node = self._roots.get(extra_key)
        path: list[TreeNode] = []
        if node is not None:
            end = len(key) - len(key) % self.page_size
            matched = 0
            while matched < end:
                child = node.children.get(self._child_key(key[matched:]))
                if child is None:
                    break
                n = self._match_len(child.key, key[matched:end])
                edge_len = len(child.key)
                if n < edge_len:
                    child = self._split(child, n)
                path.append(child)
                matched += n
                node = child
                if n < edge_len:
                    break
            self._touch(node)
        result = self._match_result(path, node)
        if record_stats:
            self.record_hit(result.handle, len(key), result.device_len)
        return result

    def _match_result(self, path: list[TreeNode], last: TreeNode | None) -> MatchResult:
        """The match along ``path`` (the matched nodes from the root down)."""
        if not path:
            return MatchResult(device_indices=EMPTY_INDICES, handle=last, device_len=0)
        values = [n.value for n in path]
        indices = values[0] if len(values) == 1 else torch.cat(values)
        return MatchResult(device_indices=indices, handle=last, device_len=len(indices))

    def peek_prefix(self, token_ids: TokenIds, extra_key: Any = None) -> PrefixPeek:
        key = as_token_array(token_ids)
        node = self._roots.get(extra_key)
        if node is None:
            return PrefixPeek(0)
        end = len(key) - len(key) % self.page_size
        matched, path = 0, [node.id]
        while matched < end:
            child = node.children.get(self._child_key(key[matched:]))
            if child is None:
                break
            n = self._match_len(child.key, key[matched:end])
            if n == 0:
                break
            matched += n
            path.append(child.id)
            if n < len(child.key):
                break
            node = child
        return PrefixPeek(matched, tuple(path))

    def insert(self, token_ids: TokenIds, indices: torch.Tensor, extra_key: Any = None) -> int:
        key = as_token_array(token_ids)
        if len(indices) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(indices)} slot indices")
        end = len(key) - len(key) % self.page_size
        if end == 0:
            return 0
        node = self._root(extra_key)
        pos = 0
        taken_from: int | None = None  # the first position whose slots the tree took over
        while pos < end:
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                value = indices[pos:end].to(torch.int64, copy=True)
                node = self._add_leaf(node, key[pos:end].copy(), value)
                break
            n = self._match_len(child.key, key[pos:end])
            if n < len(child.key):
                child = self._split(child, n)
            if not self._reuse(child, indices[pos : pos + n]) and taken_from is None:
                taken_from = pos
            pos += n
            node = child
        self._touch(node)
        return pos if taken_from is None else taken_from

    def record_hit(
        self,
        node: TreeNode | None,
        lookup_tokens: int,
        hit_tokens: int,
        host_tokens: int = 0,
        storage_tokens: int = 0,
    ) -> None:
        super().record_hit(node, lookup_tokens, hit_tokens, host_tokens, storage_tokens)
        self.admissions += 1
        n = node
        while n is not None and n.parent is not None:
            n.hit_count += 1
            n = n.parent
        if node is not None and node.parent is not None:
            self._heap.note_hit(node, self._is_evictable_leaf)
        if node in self._evictable_leaves:
            self._heap.push(node)  # its priority changed (LFU, cost-aware, threshold)

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        if node is not None and node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on an unlocked node {node!r}")
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if self._is_leaf(node):
                    self._mark_leaf(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        self.stats.evict_calls += 1
        freed = 0
        while freed < num_tokens:
            leaf = self._heap.pop(self._is_evictable_leaf)
            if leaf is None:
                break
            freed += self._remove_leaf(leaf)
        return freed

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def reset(self) -> int:
        freed = self.evict(self._evictable_size)
        if self.total_size() == 0:
            self._emit(AllBlocksCleared())
        return freed

    # ------------------------------------------------------------------ inspection
    def summary(self, top: int = 10) -> TreeSummary:
        return tree_summary(self, top)

    def check_integrity(self, held_indices: torch.Tensor | None = None) -> None:
        check_tree(self, held_indices)
