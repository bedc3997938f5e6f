"""HostNodes: the radix tree's nodes whose KV is in host memory (a part of ``RadixCache``).

The tier controller (``tier_controller.py``) copies KV between the device and the host and
records the result in the tree through these methods; the tree never moves KV itself. A
node's host copy is ``TreeNode.host_value`` (host slot indices, the tree's while it holds
them) and ``host_window`` says whether the copy has the window layers' KV:

- ``set_host``: a device node was copied to the host;
- ``set_device``: an off-device node got device slots (loaded back, or computed again);
- ``attach_host``: pages fetched from storage hang below a cached prefix as host-only nodes;
- ``evict_host``: host-only leaves are deleted, lowest priority first, from a second heap of
  the tree's eviction policy (``pinned`` keeps the end of a match being loaded from it).

Invariants (with the tree's): the nodes off the device form the tail of every path; every
node is on some tier; ``host_size`` counts the tokens with a host copy and the host-leaf set
holds exactly the off-device nodes without children. Deleting a host-only node tells the
listeners (``on_host_removed``: the tier controller frees its host slots).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from radixserve.cache.base import MatchResult, Namespace, TokenIds, as_token_array
from radixserve.cache.eviction import EvictionPolicy, LeafHeap
from radixserve.cache.tree_listener import TreeListener
from radixserve.cache.tree_node import TreeNode


class HostNodes:
    # the tree's own, which these methods keep up to date with it
    _roots: dict[Any, TreeNode]
    _listeners: tuple[TreeListener, ...]
    _evictable_leaves: set[TreeNode]
    _evictable_size: int
    _clock: int
    _walk: Callable[..., tuple[list[TreeNode], Any]]
    _touch: Callable[[TreeNode | None], None]
    _root: Callable[[Namespace], TreeNode]
    _new_node: Callable[..., TreeNode]
    _child_key: Callable[[np.ndarray], Any]
    _is_leaf: Callable[[TreeNode], bool]
    _mark_leaf: Callable[[TreeNode], None]
    inc_lock_ref: Callable[[TreeNode | None], None]
    dec_lock_ref: Callable[[TreeNode | None], None]

    def _init_host_nodes(self, policy: EvictionPolicy, clock: Callable[[], int]) -> None:
        self._host_heap = LeafHeap(policy, clock)
        self._host_leaves: set[TreeNode] = set()  # off the device, no children
        self._host_size = 0  # tokens with a host copy
        self._pinned: set[TreeNode] = set()  # host nodes a load in progress reads (pinned)

    def _mark_host_leaf(self, node: TreeNode) -> None:
        self._host_leaves.add(node)
        self._host_heap.push(node)

    def host_size(self) -> int:
        """Tokens with a host copy (some of them also on the device)."""
        return self._host_size

    def set_host(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Record that a device node's KV was copied to these host slots."""
        node.host_value = slots
        node.host_window = node.window
        self._host_size += len(node.key)
        for listener in self._listeners:
            listener.on_host(node)

    def set_device(self, node: TreeNode, slots: torch.Tensor, window: bool = True) -> None:
        """An off-device node gets device slots (its KV is there, or about to be);
        ``window`` False: without the window layers' KV (loaded from a tombstone's copy)."""
        node.value = slots
        self._host_leaves.discard(node)
        self._evictable_leaves.discard(node.parent)  # it has a device child now
        self._evictable_size += len(node.key)  # off-device nodes are never locked
        if self._is_leaf(node):
            self._mark_leaf(node)
        for listener in self._listeners:
            listener.on_loaded(node, window)

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
        self._host_size -= size
        self._host_leaves.discard(leaf)
        del parent.children[self._child_key(leaf.key)]
        for listener in self._listeners:
            listener.on_host_removed(leaf)  # the tier controller frees its host slots
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
                    host_slots: torch.Tensor,
                    window: np.ndarray | None = None) -> tuple[int, torch.Tensor]:  # fmt: skip
        """Hang pages fetched into ``host_slots`` (tokens ``[start, start + len)``) below the
        cached prefix ``[0, start)``; the tree takes the new ones. Returns the tokens added
        (0 if the prefix is no longer cached) and the host slots it let go, for the caller
        to free: those it did not take, and the copies replaced by fetched ones.

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
            return 0, host_slots
        taken = torch.zeros(len(host_slots), dtype=torch.bool)
        unused = []
        for node in path:  # cached meanwhile: duplicates, unless they bring the window KV
            a, b = node.depth - len(node.key) - start, node.depth - start
            if a >= 0 and node.value is None and not node.host_window and window[a:b].all():
                unused.append(node.host_value)
                node.host_value = host_slots[a:b].to(torch.int64, copy=True)
                node.host_window = taken[a:b] = True
        dup = pos - start
        unused = torch.cat([*unused, host_slots[:dup][~taken[:dup]]])
        if pos == len(key):
            return 0, unused
        parent = last if last is not None else self._root(namespace)
        rest = window[dup:]
        cuts = [0, *(np.flatnonzero(rest[1:] != rest[:-1]) + 1).tolist(), len(rest)]
        for a, b in zip(cuts, cuts[1:], strict=False):
            parent = self._add_host_node(parent, key[pos + a : pos + b].copy(),
                                         host_slots[dup + a : dup + b], bool(rest[a]))  # fmt: skip
        self._mark_host_leaf(parent)
        return len(key) - pos, unused

    def _add_host_node(self, parent: TreeNode, key: np.ndarray, slots: torch.Tensor,
                       window: bool) -> TreeNode:  # fmt: skip
        node = self._new_node(parent, key, None, parent.namespace)
        node.host_value = slots.to(torch.int64, copy=True)
        node.host_window = window
        node.last_access = self._clock
        node.depth = parent.depth + len(key)
        parent.children[self._child_key(key)] = node
        self._host_size += len(key)
        self._host_leaves.discard(parent)
        for listener in self._listeners:
            listener.on_host_added(node)
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
