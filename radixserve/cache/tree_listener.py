"""How features attach to the radix tree: listeners of its nodes, and where prefixes resume.

The tree (``radix_cache.py``) alone matches, inserts, splits, locks and evicts its nodes. A
feature that keeps its own state about nodes, announces them, or copies their KV between
tiers is a ``TreeListener``: the tree calls every listener it holds at the few points where
a node's life changes, and a listener overrides only the callbacks it needs (the others do
nothing). The listeners of a tree:

- ``window_tree.WindowKeeper`` (order 0): a model's window layers kept apart: tombstones,
  window locks, revival;
- ``event_feed.EventFeed`` (order 1): KV events, held by the tree only while they are on;
- ``tier_controller.TierController`` (order 2): the host and storage tiers below the device.

Order. Where something arrives (a node cached, loaded, copied) listeners are called in
ascending ``order``; where something leaves (``on_leave_device``), in descending order. So
state that others read (a node's window flag) is set before the events that announce it and
cleared after the events that withdraw it, and the tier controller, which may copy the node
(and so call back into the tree), hears last. A listener may change the tree (copy a node to
the host, split the path it locks, set a window flag) from ``on_cached``, ``on_hit``,
``on_lock``, ``on_recomputed`` and ``before_evict``; the other callbacks come in the middle
of a change and only read it.

Where a cached prefix can be resumed is the one decision a feature makes for the tree:
``ResumePoints`` (``EVERY_POINT`` unless window layers are kept apart, where a prefix whose
window KV was dropped cannot be resumed from, and new paths are cut where chat turns end).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from radixserve.cache.tree_node import TreeNode


class TreeListener:
    """What a feature hears of the tree's nodes; every callback does nothing unless overridden."""

    order = 0  # arrivals in ascending order, departures in descending order

    # ------------------------------------------------------------------ arrivals
    def on_cached(self, node: TreeNode) -> None:
        """A computed leaf entered the tree, on the device (with every layer's KV)."""

    def on_loaded(self, node: TreeNode, window: bool) -> None:
        """An off-device node got device slots: loaded back from its host copy, or computed
        again; ``window`` False: without the window layers' KV (a tombstone's copy)."""

    def on_recomputed(self, node: TreeNode, indices: torch.Tensor, start: int) -> None:
        """A device node's tokens were computed again by a request, into its slots
        ``indices[start : start + len(node.key)]`` (which the tree does not take)."""

    def on_host(self, node: TreeNode) -> None:
        """A device node got a host copy (``node.host_value``)."""

    def on_host_added(self, node: TreeNode) -> None:
        """A host-only node entered the tree (pages fetched from storage)."""

    # ------------------------------------------------------------------ changes
    def on_split(self, upper: TreeNode, lower: TreeNode, n: int) -> None:
        """``upper`` is the first ``n`` tokens cut from ``lower``'s edge; nothing cached changed."""

    def on_hit(self, node: TreeNode | None) -> None:
        """A request was admitted on the path ending at ``node`` (its hit counts are updated)."""

    def on_lock(self, node: TreeNode | None) -> None:
        """A request is about to lock the path ending at ``node`` (to resume after it)."""

    def on_unlock(self, node: TreeNode | None) -> None:
        """A request is about to unlock the path ending at ``node``."""

    def on_window(self, node: TreeNode, window: bool) -> None:
        """A device node's window-layer KV is about to be dropped (``window`` False) or
        brought back (``window_tree.py``); the tree sets ``node.window`` after."""

    # ------------------------------------------------------------------ departures
    def before_evict(self, node: TreeNode) -> None:
        """A device leaf without a host copy is about to be evicted (not in a reset, which
        drops everything); a copy made now keeps the node in the tree."""

    def on_leave_device(self, node: TreeNode) -> None:
        """``node``'s device slots are about to be freed (called in descending order)."""

    def on_left_device(self, node: TreeNode) -> None:
        """``node``'s device slots were freed; it stays in the tree as a host-only node when
        it has a host copy, else it is deleted."""

    def on_host_removed(self, node: TreeNode) -> None:
        """A host-only node was deleted; its host slots (``node.host_value``) are no longer
        the tree's."""

    def on_cleared(self) -> None:
        """A reset left the tree empty on every tier."""

    # ------------------------------------------------------------------ integrity
    def check(self, held: torch.Tensor | None) -> None:
        """Raise ``AssertionError`` if the listener's own state disagrees with the tree
        (``held``: the slots running requests hold, when the caller knows them)."""


class ResumePoints(Protocol):
    """Where a cached prefix can be resumed from, and where a new path is cut into nodes."""

    def usable(self, path: list[TreeNode], matched: int) -> int:
        """The longest prefix of the first ``matched`` tokens along ``path`` (nodes from the
        root down, the last maybe matched in part) that can be resumed from."""

    def usable_path(self, path: list[TreeNode], last: TreeNode) -> tuple[list[TreeNode], TreeNode]:
        """A matched ``path`` (ending in ``last``) cut back to its longest usable prefix,
        splitting the node it ends in; and its last node."""

    def turn_ends(self, key: np.ndarray) -> list[int]:
        """The points of ``key`` (a new path below a page boundary) where it is cut into
        nodes flagged ``turn_end`` (0: the node above it ends there)."""


class EveryPoint:
    """Every cached prefix can be resumed from wherever it ends; a new path is one node."""

    def usable(self, path: list[TreeNode], matched: int) -> int:
        return matched

    def usable_path(self, path: list[TreeNode], last: TreeNode) -> tuple[list[TreeNode], TreeNode]:
        return path, last

    def turn_ends(self, key: np.ndarray) -> list[int]:
        return []


EVERY_POINT = EveryPoint()
