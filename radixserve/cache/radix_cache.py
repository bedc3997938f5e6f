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

Lower tiers: with a tier controller attached (``attach_tiers``; ``tier_controller.py``), a
node's KV may also, or only, be in host memory (``TreeNode.host_value``). The tree records
where each node's KV lives and never moves any: the controller copies KV and tells the tree
(``set_host``, ``set_device``, ``attach_host``); the tree tells the controller what happened
to a node (``LowerTiers``: cached, hit, about to leave the device). Invariants then:

- the device nodes are closed under ancestors, so off-device nodes form the tail of every
  path and a match is one contiguous prefix: device part, then host part;
- locks, the evictable/protected sizes and the device-leaf heap concern device tokens only
  (a device leaf: nothing below it is on the device);
- a device leaf that is evicted keeps its node when it has a host copy, else is deleted
  with its host-only children; host eviction deletes off-device nodes without children,
  lowest priority first, from a second heap of the same policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any, Protocol

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
from radixserve.cache.events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventQueue,
    default_block_size,
)
from radixserve.cache.eviction import EvictionPolicy, LeafHeap, make_policy
from radixserve.cache.storage import ClearResult
from radixserve.cache.tree_check import TreeState, check_host_tier, check_tree, tree_summary, walk
from radixserve.cache.tree_events import TreeEvents
from radixserve.cache.tree_node import TreeNode
from radixserve.cache.window_tree import WindowKeeper

__all__ = ["LowerTiers", "RadixCache", "TreeNode"]


class LowerTiers(Protocol):
    """What the tree tells the tier controller, and asks of it (``tier_controller.py``)."""

    def on_cached(self, node: TreeNode) -> None:
        """A computed node entered the tree (on the device)."""

    def on_hit(self, node: TreeNode) -> None:
        """A request was admitted on the path ending at ``node``."""

    def before_evict(self, node: TreeNode) -> None:
        """A device node without a host copy is about to leave the device."""

    def free_host(self, slots: torch.Tensor) -> None:
        """The tree dropped these host slots (a deleted host-only node)."""

    def check(self, host_slots: torch.Tensor) -> None:
        """Integrity of the host pool, given the host slots the tree caches."""


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
        self._hasher = TreeEvents(
            self.page_size,
            event_block_size or default_block_size(self.page_size),
            self.roots,
            self.node_medium,
            allocator.window if allocator.windowed else None,
        )
        self.stats = CacheStats()
        self._next_id = 0
        self._clock = 0
        self._roots: dict[Any, TreeNode] = {}
        self._evictable_leaves: set[TreeNode] = set()
        self._evictable_size = 0
        self._protected_size = 0
        self.controller: Any = None  # a LowerTiers, set by attach_tiers
        self._host_heap = LeafHeap(eviction_policy, lambda: self.admissions)
        self._host_leaves: set[TreeNode] = set()  # off the device, no children
        self._host_size = 0  # tokens with a host copy
        self._pinned: set[TreeNode] = set()  # host nodes a load in progress reads (pinned)
        self._flushing = False  # reset: nodes leave the device without a copy
        # sliding-window layers kept apart: their KV is dropped where no request can read it
        self.windows = WindowKeeper(self, allocator) if allocator.windowed else None
        if event_queue is not None:
            self.events = event_queue  # an empty tree: nothing to snapshot

    def attach_tiers(self, controller: LowerTiers) -> None:
        """Let ``controller`` keep what leaves the device (before anything is cached)."""
        if self.total_size():
            raise RuntimeError("lower tiers are attached to an empty tree only")
        self.controller = controller

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

    def emit_event(self, event: KVEvent | None) -> None:
        """Queue ``event`` while events are on, else drop it. ``self.events`` is the one
        on/off state, and every event goes out through here, those emitted later too (a
        storage write-out's callback): a subscriber leaving meanwhile costs the event, never
        a step."""
        if self.events is not None and event is not None:
            self.events.append(event)

    def snapshot_events(self) -> list[BlockStored]:
        """Every cached block as ``BlockStored`` events, parents first (a full dump)."""
        return self._hasher.snapshot()

    def node_medium(self, node: TreeNode) -> str:
        """The tier a node's KV is read from: the device when it is there, else the host."""
        return MEDIUM_DEVICE if node.value is not None else MEDIUM_HOST

    def stored_event(self, node: TreeNode, medium: str) -> BlockStored | None:
        """The event announcing ``node``'s blocks on ``medium`` (None: events off or no
        whole block), under the hashes the node already holds."""
        return self._hasher.stored(node, medium) if self.events is not None else None

    def set_window(self, node: TreeNode, window: bool) -> None:
        """Set whether a device node keeps its window layers' KV (``window_tree.py``),
        announcing the blocks that become window-less or whole again."""
        if self.events is None:
            node.window = window
            return
        for event in self._hasher.set_window(node, window):
            self.emit_event(event)

    def _windowless_event(self, node: TreeNode, arriving: bool) -> None:
        """After ``node``'s device blocks are announced, its window-less ones; or, before
        they leave the device, their withdrawal."""
        if self.events is not None and self.windows is not None:
            self.emit_event(self._hasher.windowless(node, arriving))

    def _event(self, kind: type, node: TreeNode, medium: str) -> None:
        """Announce that ``node``'s blocks moved onto (BlockStored) or off (BlockRemoved)
        ``medium``, under the block hashes the node already holds (nothing is hashed again)."""
        if self.events is None:
            return
        if kind is BlockRemoved:
            if node.page_hashes:
                self.emit_event(BlockRemoved(node.page_hashes, node.namespace, medium))
            return
        self.emit_event(self._hasher.stored(node, medium))

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

    def _is_leaf(self, node: TreeNode) -> bool:
        """Whether nothing below ``node`` holds device slots (so evicting it frees a leaf)."""
        if not node.children:
            return True
        return self.controller is not None and all(c.value is None for c in node.children.values())

    def _mark_leaf(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node)
        self._heap.push(node)

    def _mark_host_leaf(self, node: TreeNode) -> None:
        self._host_leaves.add(node)
        self._host_heap.push(node)

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
        if self.events is not None:
            self._hasher.split(mid, child, n)
        parent.children[self._child_key(mid.key)] = mid
        child.key, child.parent = child.key[n:], mid
        mid.children[self._child_key(child.key)] = child
        self._heap.note_split(mid, child)
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
        if self.windows is not None:
            self.windows.on_cached(leaf)
        if self.events is not None:
            self.emit_event(self._hasher.hash_node(leaf))
            self._windowless_event(leaf, arriving=True)
        if self.controller is not None:
            self.controller.on_cached(leaf)
        return leaf

    def _add_path(self, parent: TreeNode, key: np.ndarray, value: torch.Tensor) -> TreeNode:
        """Cache ``key -> value`` below ``parent``: one leaf or, for a model with window
        layers kept apart, a chain of nodes cut where turns end (``WindowKeeper.turn_ends``),
        each flagged ``turn_end``; returns the last."""
        start, ends = 0, self.windows.turn_ends(key) if self.windows is not None else []
        for end in ends:
            if end:
                parent = self._add_leaf(parent, key[start:end], value[start:end])
                start = end
            if parent.parent is not None:
                parent.turn_end = True
        if start < len(key):
            parent = self._add_leaf(parent, key[start:], value[start:])
        return parent

    def _remove_leaf(self, leaf: TreeNode) -> int:
        """Evict a device leaf: it stays as a host-only node when it has (or the controller
        gives it) a host copy; otherwise it is deleted, with any host-only children."""
        if self.controller is not None and leaf.host_value is None and not self._flushing:
            self.controller.before_evict(leaf)
        if leaf.host_value is not None:
            return self._drop_device(leaf)
        for child in list(leaf.children.values()):
            self._delete_host_subtree(child)  # nothing to hang below: drop them
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        if self.windows is not None:
            self._windowless_event(leaf, arriving=False)
            self.windows.on_leave_device(leaf)
        self.allocator.free(leaf.value)
        del parent.children[self._child_key(leaf.key)]
        self._evictable_leaves.discard(leaf)
        size = len(leaf.key)
        self._evictable_size -= size
        self.stats.evicted_tokens += size
        self.stats.evictions += 1
        if self.events is not None:
            self.emit_event(self._hasher.removed(leaf))
        if parent.parent is not None:
            if parent.lock_ref == 0 and self._is_leaf(parent):
                self._mark_leaf(parent)
        elif not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # an empty namespace leaves no trace
        return size

    def _drop_device(self, node: TreeNode) -> int:
        """A device leaf with a host copy leaves the device and stays in the tree."""
        size = len(node.key)
        if self.windows is not None:
            self._windowless_event(node, arriving=False)
            self.windows.on_leave_device(node)
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

    # ------------------------------------------------------------------ interface
    def match_prefix(
        self, token_ids: TokenIds, namespace: Namespace = None, record_stats: bool = True
    ) -> MatchResult:
        key = as_token_array(token_ids)
        path, node = self._walk(key, namespace)
        if node is not None:
            if self.windows is not None:
                path, node = self._usable_path(path, node)
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
        return path, node

    def _usable_path(self, path: list[TreeNode], last: TreeNode) -> tuple[list[TreeNode], TreeNode]:
        """``path`` cut back to the longest prefix whose window KV allows resuming there
        (``WindowKeeper.usable``), splitting the node it ends in; and its last node. The
        device part must end at such a point too (a load of the host part may not happen):
        where it does not, the path ends within the device part."""
        device = 0
        while device < len(path) and path[device].value is not None:
            device += 1
        on_device = sum(len(n.key) for n in path[:device])
        if device < len(path) and self.windows.usable(path[:device], on_device) < on_device:
            path, last = path[:device], (path[device - 1] if device else path[0].parent)
        u = self.windows.usable(path, sum(len(n.key) for n in path))
        pos = 0
        for k, node in enumerate(path):
            end = pos + len(node.key)
            if end > u:
                if pos < u:  # ``u`` falls inside this node: split it there
                    upper = self._split(node, u - pos)
                    return [*path[:k], upper], upper
                return path[:k], (path[k - 1] if k else node.parent)
            pos = end
        return path, last

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

    def peek_prefix(self, token_ids: TokenIds, namespace: Namespace = None) -> PrefixPeek:
        key = as_token_array(token_ids)
        node = self._roots.get(namespace)
        if node is None:
            return PrefixPeek(0)
        end = len(key) - len(key) % self.page_size
        matched, path, nodes = 0, [node.id], []
        while matched < end:
            child = node.children.get(self._child_key(key[matched:]))
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
        if self.windows is not None and matched:
            usable = self.windows.usable(nodes, matched)
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
            child = node.children.get(self._child_key(key[pos:]))
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
            elif self.windows is not None:  # a tombstone takes the window KV just computed
                self.windows.revive(child, indices[pos : pos + n].to(torch.int64))
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
        if self.controller is not None:
            self.controller.on_hit(node)

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        if self.windows is not None:
            self.windows.lock(node)
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
        if self.windows is not None:
            self.windows.unlock(node)
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
            self.emit_event(AllBlocksCleared())
        return freed

    # ------------------------------------------------------------------ host-tier nodes
    def host_size(self) -> int:
        """Tokens with a host copy (some of them also on the device)."""
        return self._host_size

    def set_host(self, node: TreeNode, slots: torch.Tensor | None) -> None:
        """Record that ``node``'s KV was copied to these host slots, or (None) that its host
        copy is gone (a node that is still on the device; the caller frees the slots)."""
        if slots is None:
            if node.value is None:
                raise RuntimeError(f"{node!r} would be on no tier")
            self._host_size -= len(node.key)
            node.host_value = None
            self._event(BlockRemoved, node, MEDIUM_HOST)
            return
        node.host_value = slots
        node.host_window = node.window
        self._host_size += len(node.key)
        self._event(BlockStored, node, MEDIUM_HOST)

    def set_device(self, node: TreeNode, slots: torch.Tensor, window: bool = True) -> None:
        """An off-device node gets device slots (its KV is there, or about to be);
        ``window`` False: without the window layers' KV (loaded from a tombstone's copy)."""
        node.value = slots
        self._host_leaves.discard(node)
        self._evictable_leaves.discard(node.parent)  # it has a device child now
        self._evictable_size += len(node.key)  # off-device nodes are never locked
        if self.windows is not None:
            self.windows.on_cached(node, window)
        if self._is_leaf(node):
            self._mark_leaf(node)
        self._event(BlockStored, node, MEDIUM_DEVICE)
        self._windowless_event(node, arriving=True)

    def evict_host(self, num_tokens: int) -> int:
        """Delete host-only leaves, lowest priority first, until ``num_tokens`` are freed."""
        freed = 0
        while freed < num_tokens:
            leaf = self._host_heap.pop(self._is_host_evictable)
            if leaf is None:
                break
            freed += self._delete_host_leaf(leaf)
        return freed

    def _is_host_evictable(self, node: TreeNode) -> bool:
        return node in self._host_leaves and node not in self._pinned

    def _delete_host_leaf(self, leaf: TreeNode) -> int:
        parent = leaf.parent
        size = len(leaf.key)
        self.controller.free_host(leaf.host_value)
        self._host_size -= size
        self._host_leaves.discard(leaf)
        del parent.children[self._child_key(leaf.key)]
        self._event(BlockRemoved, leaf, MEDIUM_HOST)
        if parent.parent is None:
            if not parent.children and parent.namespace is not None:
                del self._roots[parent.namespace]
        elif parent.value is None and not parent.children:
            self._mark_host_leaf(parent)
        return size

    def _delete_host_subtree(self, node: TreeNode) -> None:
        for child in list(node.children.values()):
            self._delete_host_subtree(child)
        self._host_leaves.add(node)  # a leaf now, whatever the heap says
        self._delete_host_leaf(node)

    def attach_host(self, token_ids: TokenIds, namespace: Namespace, start: int,
                    host_slots: torch.Tensor, window: np.ndarray | None = None) -> int:  # fmt: skip
        """Hang pages fetched into ``host_slots`` (tokens ``[start, start + len)``) below the
        cached prefix ``[0, start)``; the tree takes the new ones, the rest are freed. Returns
        the tokens added (0 if the prefix is no longer cached).

        ``window``: per token, whether its fetched KV has the window layers' (default: all
        do). Each run of equal flags becomes a node of its own (``host_window``), and a
        host-only node whose copy lacks that KV takes the fetched copy that has it."""
        key = as_token_array(token_ids)[: start + len(host_slots)]
        if window is None:
            window = np.ones(len(host_slots), dtype=bool)
        path, last = self._walk(key, namespace)  # the whole path: tombstones too
        self._touch(last)
        pos = last.depth if last is not None else 0
        if pos < start:
            self.controller.free_host(host_slots)
            return 0
        taken = torch.zeros(len(host_slots), dtype=torch.bool)
        for node in path:  # cached meanwhile: duplicates, unless they bring the window KV
            a, b = node.depth - len(node.key) - start, node.depth - start
            if a >= 0 and node.value is None and not node.host_window and window[a:b].all():
                self.controller.free_host(node.host_value)
                node.host_value = host_slots[a:b].to(torch.int64, copy=True)
                node.host_window = taken[a:b] = True
        dup = pos - start
        self.controller.free_host(host_slots[:dup][~taken[:dup]])
        if pos == len(key):
            return 0
        parent = last if last is not None else self._root(namespace)
        rest = window[dup:]
        cuts = [0, *(np.flatnonzero(rest[1:] != rest[:-1]) + 1).tolist(), len(rest)]
        for a, b in zip(cuts, cuts[1:], strict=False):
            parent = self._add_host_node(parent, key[pos + a : pos + b].copy(),
                                         host_slots[dup + a : dup + b], bool(rest[a]))  # fmt: skip
        self._mark_host_leaf(parent)
        return len(key) - pos

    def _add_host_node(self, parent: TreeNode, key: np.ndarray, slots: torch.Tensor,
                       window: bool) -> TreeNode:  # fmt: skip
        node = self._new_node(parent, key, None, parent.namespace)
        node.host_value = slots.to(torch.int64, copy=True)
        node.host_window = window
        node.last_access = self._clock
        node.depth = parent.depth + len(key)
        parent.children[self._child_key(key)] = node
        if self.events is not None:
            self._hasher.hash_node(node)  # a new node: its blocks are named here
        self._event(BlockStored, node, MEDIUM_HOST)
        self._host_size += len(key)
        self._host_leaves.discard(parent)
        return node

    @contextmanager
    def pinned(self, match: MatchResult):
        """While inside, nothing of ``match`` is evicted: its device part is locked and the
        end of its host part is kept from host eviction (making device room for a load may
        copy device leaves to the host, which may evict host leaves)."""
        end = match.lower_handle
        if end is not None:
            self._pinned.add(end)
        self.inc_lock_ref(match.handle)
        try:
            yield
        finally:
            self.dec_lock_ref(match.handle)
            if end is not None:
                self._pinned.discard(end)
                if end in self._host_leaves:
                    self._host_heap.push(end)  # an entry host eviction may have skipped

    # ------------------------------------------------------------------ lower tiers
    def load_back(self, match: MatchResult) -> MatchResult:
        if self.controller is None:
            return match
        loaded = self.controller.load_back(match)
        if self.windows is None or loaded is match:
            return loaded
        # a partial load may end where the window before it is not whole: resume earlier
        path, node = [], loaded.handle
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        path, last = self._usable_path(path[::-1], loaded.handle)
        if len(path) and path[-1] is loaded.handle:
            return loaded
        return self._match_result(path, last)

    def start_prefetch(self, token_ids: TokenIds, namespace: Namespace = None) -> Any:
        if self.controller is None:
            return None
        return self.controller.start_prefetch(token_ids, namespace)

    def poll_transfers(self, timeout: float = 0.0) -> None:
        if self.controller is not None:
            self.controller.poll(timeout)

    def tier_stats(self) -> Any:
        return self.controller.stats() if self.controller is not None else None

    def eviction_stats(self) -> Any:
        return self._heap.policy.stats()

    def clear_storage(self) -> ClearResult | None:
        return self.controller.clear_storage() if self.controller is not None else None

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()

    # ------------------------------------------------------------------ inspection
    def summary(self, top: int = 10) -> TreeSummary:
        return tree_summary(self, self.total_size(), top)

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
            check_events=self._hasher.check if self.events is not None else None,
        )

    def check_integrity(self, held_indices: torch.Tensor | None = None) -> None:
        state = self.integrity_state()
        self.allocator.check(check_tree(self, state), held_indices)
        if self.windows is not None:
            self.windows.check(held_indices)
        if self.controller is not None:
            self.controller.check(check_host_tier(self, state))
