"""EventFeed: the radix tree's KV events, a listener of its nodes (``tree_listener.py``).

While events are on, the feed is among the tree's listeners and every change of where a
node's blocks live goes out to its queue (``events.py``), under the block hashes
``tree_events.TreeEvents`` keeps on the nodes: a computed node's blocks stored on the device,
a host copy's stored on the host, blocks removed from the tier they leave, the window-less
blocks of a model whose window layers are kept apart, ``AllBlocksCleared`` after a reset that
leaves nothing. A node is hashed once, when it enters the tree; a tier move announces the
hashes it holds.

While events are off, the tree does not hold the feed: nothing is hashed, the hashes on nodes
go stale, and ``start`` recomputes them all (``AllBlocksCleared``, then the whole tree as
stored events). An event emitted later by another owner (a storage write-out's callback,
``emit``) is dropped if events went off meanwhile: a subscriber leaving costs the event,
never a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from radixserve.cache.events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventQueue,
)
from radixserve.cache.tree_check import walk
from radixserve.cache.tree_events import TreeEvents
from radixserve.cache.tree_listener import TreeListener
from radixserve.cache.tree_node import TreeNode


class Roots(Protocol):
    def roots(self) -> Iterable[TreeNode]: ...


def node_medium(node: TreeNode) -> str:
    """The tier a node's KV is read from: the device when it is there, else the host."""
    return MEDIUM_DEVICE if node.value is not None else MEDIUM_HOST


class EventFeed(TreeListener):
    """The KV events of ``tree``, in blocks of ``block_size`` tokens; ``window``: the sliding
    window of a tree whose nodes may be tombstones (None: no window layers kept apart)."""

    order = 1

    def __init__(self, tree: Roots, page_size: int, block_size: int, window: int | None):
        self.tree = tree
        self.hasher = TreeEvents(page_size, block_size, tree.roots, node_medium, window)
        self.queue: KVEventQueue | None = None  # set only while events are on

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def start(self, queue: KVEventQueue) -> None:
        """Emit ``AllBlocksCleared`` and every cached block as stored (what a subscriber knew
        may be stale: events were off) to ``queue``, which then gets every change."""
        self.queue = queue
        queue.append(AllBlocksCleared())
        for event in self.snapshot():
            queue.append(event)

    def snapshot(self) -> list[BlockStored]:
        """Every cached block as ``BlockStored`` events, parents first (hashing them anew)."""
        return self.hasher.snapshot()

    def emit(self, event: KVEvent | None) -> None:
        """Queue ``event`` while events are on, else drop it."""
        if self.queue is not None and event is not None:
            self.queue.append(event)

    def stored(self, node: TreeNode, medium: str) -> BlockStored | None:
        """The event announcing ``node``'s blocks on ``medium`` (None: events off or no whole
        block), under the hashes the node already holds."""
        return self.hasher.stored(node, medium) if self.queue is not None else None

    # ------------------------------------------------------------------ the tree's nodes
    def on_cached(self, node: TreeNode) -> None:
        self.emit(self.hasher.hash_node(node))  # a new node: its blocks are named here
        self.emit(self.hasher.windowless(node, arriving=True))

    def on_loaded(self, node: TreeNode, window: bool) -> None:
        self.emit(self.hasher.stored(node, MEDIUM_DEVICE))
        self.emit(self.hasher.windowless(node, arriving=True))

    def on_host(self, node: TreeNode) -> None:
        self.emit(self.hasher.stored(node, MEDIUM_HOST))

    def on_host_added(self, node: TreeNode) -> None:
        self.emit(self.hasher.hash_node(node))  # off the device: stored on the host

    def on_split(self, upper: TreeNode, lower: TreeNode, n: int) -> None:
        self.hasher.split(upper, lower, n)

    def on_window(self, node: TreeNode, window: bool) -> None:
        for event in self.hasher.set_window(node, window):
            self.emit(event)

    def on_leave_device(self, node: TreeNode) -> None:
        self.emit(self.hasher.windowless(node, arriving=False))

    def on_left_device(self, node: TreeNode) -> None:
        self._removed(node, MEDIUM_DEVICE)

    def on_host_removed(self, node: TreeNode) -> None:
        self._removed(node, MEDIUM_HOST)

    def on_cleared(self) -> None:
        self.emit(AllBlocksCleared())

    def _removed(self, node: TreeNode, medium: str) -> None:
        if node.page_hashes:
            self.emit(BlockRemoved(node.page_hashes, node.namespace, medium))

    def check(self, held: torch.Tensor | None) -> None:
        """Every node's offset and block hashes are current."""
        for node, _ in walk(self.tree):
            self.hasher.check(node)
