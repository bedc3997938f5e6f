"""RadixCache: every computed prefix, stored once, in a radix tree of token ids -> KV slots.

Each node's edge is a run of token ids (whole pages when ``page_size > 1``) with the matching
run of slot indices; children are keyed by their first token (first page). Namespaces
(``namespace``) get separate roots and never share nodes. The tree stores indices, never
tensors, and owns the slots of its nodes: it returns them to the allocator on eviction.

Sizes, kept in O(1):
- ``protected``: tokens in nodes with ``lock_ref > 0`` (read by running requests);
- ``evictable``: tokens in unlocked nodes. An unlocked node's subtree is unlocked too, so
  evicting leaves first, cascading to parents that become leaves, can free all of it.

Locks are taken along the whole path to the root, so ``lock_ref(node) >= sum of children's``.
Eviction pops the lowest-priority evictable leaf from a lazy heap (``eviction.LeafHeap``):
O(k log n) for k evicted leaves, never a walk of the tree.

Where a node's KV lives: on the device (``TreeNode.value``), in host memory
(``host_value``), or both. The tree records it and moves none: the tier controller
(``tier_controller.py``) copies KV and tells the tree (``set_host``, ``set_device``,
``attach_host``). Without it every node is on the device. Invariants:

- the device nodes are closed under ancestors, so off-device nodes form the tail of every
  path and a match is one contiguous prefix: device part, then host part;
- locks, the evictable/protected sizes and the device-leaf heap concern device tokens only
  (a device leaf: nothing below it is on the device);
- a device leaf that is evicted keeps its node when it has a host copy, else is deleted
  with its host-only children; host eviction deletes off-device nodes without children,
  lowest priority first, from a second heap of the same policy.

Features attach as listeners (``tree_listener.py``), called where a node is cached, loaded,
split, hit, locked, copied, or leaves a tier: the window keeper (a model's window layers kept
apart, ``window_tree.py``), the KV event feed (``event_feed.py``, while events are on) and the
tier controller. Where a cached prefix can be resumed is the keeper's rule (``ResumePoints``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from radixserve.cache.allocator import PagedAllocator
from radixserve.cache.base import (
    EMPTY_INDICES,
    CacheStats,
    MatchResult,
    Namespace,
    PrefixCache,
    PrefixPeek,
    TokenIds,
    TreeSummary,
    as_token_array,
)
from radixserve.cache.event_feed import EventFeed
from radixserve.cache.events import KVEventQueue, default_block_size
from radixserve.cache.eviction import EvictionPolicy, LeafHeap, make_policy
from radixserve.cache.host_nodes import HostNodes
from radixserve.cache.tree_check import TreeState, check_tree, tree_summary, walk
from radixserve.cache.tree_listener import EVERY_POINT, ResumePoints, TreeListener
from radixserve.cache.tree_node import TreeNode
from radixserve.cache.window_tree import WindowKeeper

__all__ = ["RadixCache", "TreeNode"]


class RadixCache(HostNodes, PrefixCache):
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
            eviction_policy = make_policy(eviction_policy, cache_threshold)
        eviction_policy.bind(self.total_size, lambda: self._clock)
        self.eviction_policy = eviction_policy.name
        self.admissions = 0  # requests admitted (record_hit calls): the policies' clock
        self._heap = LeafHeap(eviction_policy, lambda: self.admissions)
        self.stats = CacheStats()
        self._next_id = 0
        self._clock = 0
        self._roots: dict[Any, TreeNode] = {}
        self._evictable_leaves: set[TreeNode] = set()
        self._evictable_size = 0
        self._protected_size = 0
        self._init_host_nodes(eviction_policy, lambda: self.admissions)
        self._flushing = False  # reset: nodes leave the device without a copy
        self._listeners: tuple[TreeListener, ...] = ()  # ascending ``order``
        self._departures: tuple[TreeListener, ...] = ()  # the same, descending
        # sliding-window layers kept apart: their KV is dropped where no request can read it
        self.windows = WindowKeeper(self, allocator) if allocator.windowed else None
        self._points: ResumePoints = self.windows or EVERY_POINT
        if self.windows is not None:
            self.add_listener(self.windows)
        window = allocator.window if allocator.windowed else None
        block = event_block_size or default_block_size(self.page_size)
        self.event_feed = EventFeed(self, self.page_size, block, window)
        if event_queue is not None:  # an empty tree: nothing to snapshot
            self.event_feed.queue = event_queue
            self.add_listener(self.event_feed)

    # ------------------------------------------------------------------ listeners
    def add_listener(self, listener: TreeListener) -> None:
        """Let ``listener`` hear of the tree's nodes from now on (``tree_listener.py``)."""
        self._set_listeners([*self._listeners, listener])

    def remove_listener(self, listener: TreeListener) -> None:
        self._set_listeners([x for x in self._listeners if x is not listener])

    def _set_listeners(self, listeners: list[TreeListener]) -> None:
        listeners.sort(key=lambda x: x.order)
        self._listeners, self._departures = tuple(listeners), tuple(reversed(listeners))

    def set_window(self, node: TreeNode, window: bool) -> None:
        """Set whether a device node keeps its window layers' KV (the window keeper's call),
        telling the listeners first (KV events announce the blocks that change)."""
        for listener in self._listeners:
            listener.on_window(node, window)
        node.window = window

    # ------------------------------------------------------------------ events
    @property
    def events(self) -> KVEventQueue | None:  # type: ignore[override]
        return self.event_feed.queue

    @property
    def event_block_size(self) -> int:  # type: ignore[override]
        return self.event_feed.block_size

    def enable_events(self, queue: KVEventQueue) -> None:
        """Emit ``AllBlocksCleared`` and every cached block as stored, then every change."""
        self.event_feed.start(queue)
        if self.event_feed not in self._listeners:
            self.add_listener(self.event_feed)

    def disable_events(self) -> None:
        """Stop hashing and emitting; hashes kept on nodes go stale and are redone on enable."""
        self.remove_listener(self.event_feed)
        self.event_feed.queue = None

    def snapshot_events(self) -> list:
        return self.event_feed.snapshot()

    # ------------------------------------------------------------------ helpers
    def _new_node(
        self,
        parent: TreeNode | None,
        key: np.ndarray,
        value: torch.Tensor,
        namespace: Namespace = None,
    ) -> TreeNode:
        self._next_id += 1
        return self.node_class(self._next_id, parent, key, value, namespace)

    def _root(self, namespace: Namespace) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._new_node(None, np.empty(0, np.int32), EMPTY_INDICES, namespace)
            self._roots[namespace] = root
        return root

    def roots(self) -> list[TreeNode]:
        """The namespace roots (their subtrees are the whole tree), for inspection."""
        return list(self._roots.values())

    def _child_key(self, key: np.ndarray, pos: int = 0) -> Any:
        """The key of ``key[pos:]`` among its parent's children: its first token (page)."""
        p = self.page_size
        return int(key[pos]) if p == 1 else key[pos : pos + p].tobytes()

    def _match_len(self, edge: np.ndarray, key: np.ndarray) -> int:
        n = min(len(edge), len(key))
        if edge[:n].tobytes() == key[:n].tobytes():  # most edges on a path match whole
            return n - n % self.page_size
        differs = edge[:n] != key[:n]
        m = int(differs.argmax()) if differs.any() else n
        return m - m % self.page_size

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node in self._evictable_leaves

    def _is_leaf(self, node: TreeNode) -> bool:
        """Whether nothing below ``node`` holds device slots (so evicting it frees a leaf)."""
        if not node.children:
            return True
        if not self._host_size:  # every node is on some tier: here all on the device
            return False
        return all(child.value is None for child in node.children.values())

    def _mark_leaf(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node)
        self._heap.push(node)

    def _touch(self, node: TreeNode | None) -> None:
        self._clock += 1
        n, device_leaf = node, None
        while n is not None and n.parent is not None:
            n.last_access = self._clock
            if device_leaf is None and n in self._evictable_leaves:
                device_leaf = n  # ``node`` itself, or the device end above a host-only tail
            n = n.parent
        if device_leaf is not None:
            self._heap.push(device_leaf)  # its priority changed; the old entry goes stale
            self._heap.maybe_compact(self._evictable_leaves, len(self._evictable_leaves))
        if node is not None and node in self._host_leaves:
            self._host_heap.push(node)
            self._host_heap.maybe_compact(self._host_leaves, len(self._host_leaves))

    def split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut ``node``'s edge after ``n`` tokens (a page multiple); return the upper node.
        Nothing cached changes: one node becomes two."""
        if not 0 < n < len(node.key) or n % self.page_size:
            raise ValueError(f"cannot split {node!r} after {n} tokens")
        return self._split(node, n)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None
        mid = self._new_node(parent, child.key[:n], None, child.namespace)
        if child.value is not None:
            mid.value, child.value = child.value[:n], child.value[n:]
        if child.host_value is not None:
            mid.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        mid.hit_count = child.hit_count
        mid.depth, mid.created = parent.depth + n, child.created
        mid.policy_state = child.policy_state
        mid.window, mid.window_lock = child.window, child.window_lock
        mid.host_window = child.host_window
        parent.children[self._child_key(mid.key)] = mid
        child.key, child.parent = child.key[n:], mid
        mid.children[self._child_key(child.key)] = child
        self._heap.note_split(mid, child)
        for listener in self._listeners:
            listener.on_split(mid, child, n)
        return mid

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, value: torch.Tensor) -> TreeNode:
        leaf = self._new_node(parent, key, value, parent.namespace)
        leaf.depth, leaf.created = parent.depth + len(key), self.admissions
        parent.children[self._child_key(key)] = leaf
        self._evictable_leaves.discard(parent)
        self._evictable_size += len(key)
        self._clock += 1
        leaf.last_access = self._clock
        self._mark_leaf(leaf)
        for listener in self._listeners:
            listener.on_cached(leaf)
        return leaf

    def _add_path(self, parent: TreeNode, key: np.ndarray, value: torch.Tensor) -> TreeNode:
        """Cache ``key -> value`` below ``parent``: one leaf or a chain of nodes cut where the
        resume rule says turns end (``ResumePoints.turn_ends``), each flagged ``turn_end``;
        returns the last."""
        start = 0
        for end in self._points.turn_ends(key):
            if end:
                parent = self._add_leaf(parent, key[start:end], value[start:end])
                start = end
            if parent.parent is not None:
                parent.turn_end = True
        if start < len(key):
            parent = self._add_leaf(parent, key[start:], value[start:])
        return parent

    def _remove_leaf(self, leaf: TreeNode) -> int:
        """Evict a device leaf: it stays as a host-only node when it has (or a listener
        gives it) a host copy; otherwise it is deleted, with any host-only children."""
        if leaf.host_value is None and not self._flushing:
            for listener in self._listeners:
                listener.before_evict(leaf)
        if leaf.host_value is not None:
            return self._drop_device(leaf)
        for child in list(leaf.children.values()):
            self._delete_host_subtree(child)  # nothing to hang below: drop them
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        size = self._free_device(leaf)
        del parent.children[self._child_key(leaf.key)]
        if parent.parent is not None:
            if parent.lock_ref == 0 and self._is_leaf(parent):
                self._mark_leaf(parent)
        elif not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # an empty namespace leaves no trace
        return size

    def _drop_device(self, node: TreeNode) -> int:
        """A device leaf with a host copy leaves the device and stays in the tree."""
        size = self._free_device(node)
        node.value = None
        if not node.children:
            self._mark_host_leaf(node)
        parent = node.parent
        if parent.parent is not None and parent.lock_ref == 0 and self._is_leaf(parent):
            self._mark_leaf(parent)
        return size

    def _free_device(self, node: TreeNode) -> int:
        """Give an evicted device leaf's slots back to the allocator; its size."""
        for listener in self._departures:
            listener.on_leave_device(node)
        self.allocator.free(node.value)
        self._evictable_leaves.discard(node)
        size = len(node.key)
        self._evictable_size -= size
        self.stats.evicted_tokens += size
        self.stats.evictions += 1
        for listener in self._listeners:
            listener.on_left_device(node)
        return size

    # ------------------------------------------------------------------ interface
    def match_prefix(
        self, token_ids: TokenIds, namespace: Namespace = None, record_stats: bool = True
    ) -> MatchResult:
        key = as_token_array(token_ids)
        path, node = self._walk(key, namespace)
        if node is not None:
            path, node = self._points.usable_path(path, node)
            self._touch(node)
        result = self._match_result(path, node)
        if record_stats:
            self.record_hit(result.handle, len(key), result.device_len)
        return result

    def _walk(self, key: np.ndarray, namespace: Namespace) -> tuple[list[TreeNode], Any]:
        """The nodes matching ``key``'s whole pages from the root down, the last split where
        the match ends inside it, and the node the match ends in (the root for none; None
        without a root for ``namespace``)."""
        node = self._roots.get(namespace)
        path: list[TreeNode] = []
        if node is None:
            return path, node
        end = len(key) - len(key) % self.page_size
        matched = 0
        while matched < end:
            child = node.children.get(self._child_key(key, matched))
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
        return path, node

    @staticmethod
    def _match_result(path: list[TreeNode], last: TreeNode | None) -> MatchResult:
        """The match along ``path`` (the matched nodes from the root down): its device part,
        then the part only on the host (the tail of the path)."""
        k = 0
        while k < len(path) and path[k].value is not None:
            k += 1
        if k == 0:
            result = MatchResult(device_indices=EMPTY_INDICES, device_len=0,
                                 handle=path[0].parent if path else last)  # fmt: skip
        else:
            values = [n.value for n in path[:k]]
            indices = values[0] if k == 1 else torch.cat(values)
            result = MatchResult(
                device_indices=indices, handle=path[k - 1], device_len=len(indices)
            )
        if k < len(path):
            result.host_len = sum(len(n.key) for n in path[k:])
            result.lower_handle = path[-1]
        return result

    def resumable(self, loaded: MatchResult) -> MatchResult:
        """``loaded`` (a match whose device part a load just grew) cut back to the longest
        prefix a request can resume from: a partial load may end where the window before it
        is not whole (``ResumePoints.usable_path``)."""
        path, node = [], loaded.handle
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        path, last = self._points.usable_path(path[::-1], loaded.handle)
        if len(path) and path[-1] is loaded.handle:
            return loaded
        return self._match_result(path, last)

    def peek_prefix(self, token_ids: TokenIds, namespace: Namespace = None) -> PrefixPeek:
        key = as_token_array(token_ids)
        node = self._roots.get(namespace)
        if node is None:
            return PrefixPeek(0)
        end = len(key) - len(key) % self.page_size
        matched, path, nodes = 0, [node.id], []
        while matched < end:
            child = node.children.get(self._child_key(key, matched))
            if child is None:
                break
            n = self._match_len(child.key, key[matched:end])
            if n == 0:
                break
            matched += n
            path.append(child.id)
            nodes.append(child)
            if n < len(child.key):
                break
            node = child
        usable = self._points.usable(nodes, matched)
        if usable < matched:  # the nodes that start before it
            starts = np.cumsum([0] + [len(n.key) for n in nodes])[:-1]
            path = path[: 1 + int((starts < usable).sum())]
            matched = usable
        return PrefixPeek(matched, tuple(path))

    def insert(
        self, token_ids: TokenIds, indices: torch.Tensor, namespace: Namespace = None
    ) -> int:
        key = as_token_array(token_ids)
        if len(indices) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(indices)} slot indices")
        end = len(key) - len(key) % self.page_size
        if end == 0:
            return 0
        node = self._root(namespace)
        pos = 0
        taken_from: int | None = None  # the first position whose slots the tree took over
        while pos < end:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                value = indices[pos:end].to(torch.int64, copy=True)
                node = self._add_path(node, key[pos:end].copy(), value)
                break
            n = self._match_len(child.key, key[pos:end])
            if n < len(child.key):
                child = self._split(child, n)
            if child.value is None:  # off the device and recomputed: take the caller's slots
                self.set_device(child, indices[pos : pos + n].to(torch.int64, copy=True))
                if taken_from is None:
                    taken_from = pos
            else:  # on the device: the caller computed it again (its slots stay the caller's)
                for listener in self._listeners:
                    listener.on_recomputed(child, indices, pos)
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
        for listener in self._listeners:
            listener.on_hit(node)

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        for listener in self._listeners:
            listener.on_lock(node)
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
        for listener in self._listeners:
            listener.on_unlock(node)
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

    def evict_windows(self, num_tokens: int) -> int:
        return self.windows.evict(num_tokens) if self.windows is not None else 0

    def window_evictable_size(self) -> int:
        return self.windows.evictable_size() if self.windows is not None else 0

    def set_turn_end_ids(self, token_ids: Iterable[int]) -> None:
        if self.windows is not None:
            self.windows.set_turn_end_ids(token_ids)

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def reset(self) -> int:
        """Drop everything unlocked from the device (no copies to the host: everything
        goes) and from the host."""
        self._flushing = True
        try:
            freed = self.evict(self._evictable_size)
        finally:
            self._flushing = False
        freed += self.evict_host(self._host_size)
        if self.total_size() == 0 and self._host_size == 0:
            for listener in self._listeners:
                listener.on_cleared()
        return freed

    # ------------------------------------------------------------------ inspection
    def summary(self, top: int = 10) -> TreeSummary:
        return tree_summary(self, self.total_size(), top)

    def eviction_stats(self) -> Any:
        return self._heap.policy.stats()

    def nodes(self):
        """Every non-root node with its depth in tokens (a walk of the whole tree)."""
        return walk(self)

    def integrity_state(self) -> TreeState:
        """The tree's own bookkeeping, for ``tree_check`` to compare with its nodes."""
        return TreeState(
            roots=dict(self._roots),
            page_size=self.page_size,
            evictable_size=self._evictable_size,
            protected_size=self._protected_size,
            evictable_leaves=set(self._evictable_leaves),
            evictable_live=self._heap.live_nodes(self._is_evictable_leaf),
            host_size=self._host_size,
            host_leaves=set(self._host_leaves),
            host_live=self._host_heap.live_nodes(self._host_leaves.__contains__),
            is_leaf=self._is_leaf,
            child_key=self._child_key,
        )

    def check_integrity(self, held_indices: torch.Tensor | None = None) -> None:
        """The tree's invariants and its device slots (``tree_check``), then each
        listener's own (window flags, block hashes, the host pool)."""
        self.allocator.check(check_tree(self, self.integrity_state()), held_indices)
        for listener in self._listeners:
            listener.check(held_indices)
