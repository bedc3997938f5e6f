"""Sliding-window layers in the radix tree: local-layer KV kept only where it can be read.

With a model's window layers kept apart (``window_pages.py``), every device node holds the
global layers' KV of its tokens, and its window layers' KV unless it is a *tombstone*
(``TreeNode.window`` False). A local layer with window ``W`` computing the token at index
``u`` reads the keys ``[u - W + 1, u]``, so:

- **usable prefix**: a cached prefix can be resumed at ``u`` only if no tombstone overlaps
  ``[u - W + 1, u)``. A match is cut back to the longest such ``u`` (``usable``): the end of
  the path, or the start of a tombstone;
- **window locks**: a request resuming at ``m`` (its lock handle) needs the window KV of
  ``[a, m)``, ``a = m - W + 1`` rounded down to a page. Locking splits the path at ``a`` and
  counts a window lock on each node from ``a`` to ``m``; a node with a window lock keeps its
  window KV. Every window-locked node lies wholly inside each of its lockers' ranges, so a
  split copies the count to both halves, as it copies ``lock_ref``;
- **turn ends**: a new path is cut into nodes after each token that ends a chat turn
  (``turn_end_ids``, rounded down to a page; ``turn_ends``), and such a node is flagged
  ``turn_end``: another conversation that shares the first messages (a system prompt, a
  document) resumes there, though no branch point is there yet;
- **tombstoning** (``evict``), when the window pool runs short: nodes with window KV and no
  window lock lose it (the global KV and the path stay). A node with one child needs only the
  last ``W - 1 - d`` tokens of its window KV, where ``d`` is the distance from its end down to
  the nearest resume point. In three classes, each least recently used first: the parts no
  resume point needs (turn ends counted as resume points); the parts only turn ends need
  (resume points being the leaves and branch points, where requests resume: a
  conversation's next turn, a shared system prompt's next request); then whole nodes. A part
  is split off and tombstoned, keeping the node's tail. Each call frees at least an eighth
  of the window pool, so its scan of the tree is paid for by many allocations;
- **revival**: inserting tokens over a tombstone whose KV the caller has just computed again
  moves the caller's window pages to the node (``WindowedAllocator.move_windows``);
- **the host tier** copies a node with whatever it has (``TreeNode.host_window``: whether the
  copy has window KV); a host-only node counts as a tombstone in ``usable`` unless its copy
  has window KV, and a node loaded back from a copy without it is a tombstone again;
- **KV events**: tombstoning and revival set the flag through the tree (``Tree.set_window``),
  whose event feed announces the device blocks that become window-less or whole again
  (``event_feed.py``), as it announces a node that arrives on the device as a tombstone.

The keeper is a listener of the tree (``tree_listener.py``, order 0: a node's flag is set
before the events announcing it): it hears nodes arrive on and leave the device, locks and
recomputed tokens; and it is the tree's ``ResumePoints``: ``usable``, ``usable_path`` and
``turn_ends`` are the tree's decisions it makes.

Counted in O(1): ``window_size`` (tokens of device nodes with window KV) and its part under a
window lock; the rest can be tombstoned. ``check`` verifies every field against the nodes and
the allocator.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from radixserve.cache.tree_check import walk
from radixserve.cache.tree_listener import TreeListener
from radixserve.cache.tree_node import TreeNode

if TYPE_CHECKING:
    from radixserve.cache.window_pages import WindowedAllocator


class Tree(Protocol):
    """What the keeper needs of the radix tree that owns it."""

    def roots(self) -> Iterable[TreeNode]: ...

    def split(self, node: TreeNode, n: int) -> TreeNode: ...

    def set_window(self, node: TreeNode, window: bool) -> None:
        """Set ``node.window`` on a device node, announcing it in the tree's KV events."""


EVICT_SHARE = 8  # a tombstoning call frees at least 1/EVICT_SHARE of the window pool


class WindowKeeper(TreeListener):
    order = 0

    def __init__(self, tree: Tree, allocator: WindowedAllocator):
        self.tree = tree
        self.allocator = allocator
        self.window = allocator.window  # keys a local layer reads, its own token included
        self.page_size = allocator.page_size
        self.window_size = 0  # tokens of device nodes with window KV
        self.locked_size = 0  # of which under a window lock
        self.tombstoned_tokens = 0  # monotonic: window KV dropped, in tokens
        self.turn_end_ids = np.zeros(0, dtype=np.int64)  # tokens that end a chat turn

    def set_turn_end_ids(self, token_ids: Iterable[int]) -> None:
        self.turn_end_ids = np.unique(np.asarray(list(token_ids), dtype=np.int64))

    def turn_ends(self, key: np.ndarray) -> list[int]:
        """The points of ``key`` (a new path below a page boundary) right after a turn-end
        token, rounded down to a page: where the tree cuts it into nodes flagged
        ``turn_end`` (0: the node above it ends there)."""
        if not len(self.turn_end_ids):
            return []
        ends = np.flatnonzero(np.isin(key, self.turn_end_ids)) + 1
        return np.unique(ends - ends % self.page_size).tolist()

    def evictable_size(self) -> int:
        return self.window_size - self.locked_size

    # ------------------------------------------------------------------ node events
    def on_cached(self, node: TreeNode) -> None:
        self.on_loaded(node, True)

    def on_loaded(self, node: TreeNode, window: bool) -> None:
        """A node got device slots: with window KV (a new leaf, a host node recomputed, or
        loaded from a host copy that has it), or without (``window`` False: a host copy of a
        tombstone, or a load's part far from its end; the slots' window pages, if any, go
        back). The tree announces its window-less blocks with its device blocks."""
        node.window = window
        if window:
            self.window_size += len(node.key)
        elif bool(self.allocator.has_windows(node.value).any()):
            self.allocator.drop_windows(node.value)

    def on_leave_device(self, node: TreeNode) -> None:
        """A node's device slots (and their window pages) are about to be freed."""
        if node.window:
            self.window_size -= len(node.key)
        node.window = False

    def on_recomputed(self, node: TreeNode, indices: torch.Tensor, start: int) -> None:
        """The caller's slots (KV just computed) hold ``node``'s tokens again: the node takes
        over their window pages if it is a tombstone."""
        if node.window:
            return
        slots = indices[start : start + len(node.key)].to(torch.int64)
        if torch.equal(slots, node.value):
            return
        self.allocator.move_windows(slots, node.value)
        self.tree.set_window(node, True)
        self.window_size += len(node.key)
        if node.window_lock:
            self.locked_size += len(node.key)

    # ------------------------------------------------------------------ usable prefix
    def usable(self, path: list[TreeNode], matched: int) -> int:
        """The longest prefix of the first ``matched`` tokens along ``path`` (nodes from the
        root down, the last maybe matched in part) that can be resumed from."""
        spans, pos = [], 0
        for node in path:
            if not (node.window if node.value is not None else node.host_window):
                spans.append((pos, min(pos + len(node.key), matched)))
            pos += len(node.key)
        u = matched
        for start, end in reversed(spans):
            if start < u and end > u - (self.window - 1):
                u = start
        return u

    def usable_path(self, path: list[TreeNode], last: TreeNode) -> tuple[list[TreeNode], TreeNode]:
        """``path`` cut back to the longest prefix whose window KV allows resuming there
        (``usable``), splitting the node it ends in; and its last node. The device part must
        end at such a point too (a load of the host part may not happen): where it does not,
        the path ends within the device part."""
        device = 0
        while device < len(path) and path[device].value is not None:
            device += 1
        on_device = sum(len(n.key) for n in path[:device])
        if device < len(path) and self.usable(path[:device], on_device) < on_device:
            path, last = path[:device], (path[device - 1] if device else path[0].parent)
        u = self.usable(path, sum(len(n.key) for n in path))
        pos = 0
        for k, node in enumerate(path):
            end = pos + len(node.key)
            if end > u:
                if pos < u:  # ``u`` falls inside this node: split it there
                    upper = self.tree.split(node, u - pos)
                    return [*path[:k], upper], upper
                return path[:k], (path[k - 1] if k else node.parent)
            pos = end
        return path, last

    # ------------------------------------------------------------------ window locks
    def _lock_start(self, node: TreeNode) -> int:
        return self.allocator.window_start(node.depth)

    def on_lock(self, node: TreeNode | None) -> None:
        """Window-lock the nodes from ``node``'s lock start down to ``node``."""
        if node is None or node.parent is None:
            return
        a = self._lock_start(node)
        while node.parent is not None and node.depth > a:
            start = node.depth - len(node.key)
            if start < a:
                self.tree.split(node, a - start)  # ``node`` keeps [a, end)
            if node.window_lock == 0 and node.window:
                self.locked_size += len(node.key)
            if not node.window:
                raise AssertionError(f"window-locking {node!r}, a tombstone")
            node.window_lock += 1
            node = node.parent

    def on_unlock(self, node: TreeNode | None) -> None:
        if node is None or node.parent is None:
            return
        a = self._lock_start(node)
        while node.parent is not None and node.depth > a:
            node.window_lock -= 1
            if node.window_lock < 0:
                raise RuntimeError(f"window unlock of {node!r}, not locked")
            if node.window_lock == 0:
                self.locked_size -= len(node.key)
            node = node.parent

    # ------------------------------------------------------------------ tombstoning
    def evict(self, num_tokens: int) -> int:
        """Tombstone unlocked window KV until ``num_tokens`` (and at least a share of the
        window pool) are freed, or nothing more can be; returns the tokens freed."""
        if num_tokens <= 0:
            return 0
        target = max(num_tokens, self.allocator.window_slots // EVICT_SHARE)
        freed = 0
        for _ in range(3):  # the tails a pass keeps are candidates of a later class then
            for _, _, _, node, keep in self._candidates():
                if freed >= target:
                    return freed
                if keep:
                    node = self.tree.split(node, len(node.key) - keep)  # the upper part
                freed += self._tombstone(node)
        return freed

    def _candidates(self) -> list[tuple]:
        """Unlocked nodes with window KV, in tombstoning order: ``(class, last access, id,
        node, tokens to keep at its end)``; class 0 is a part no resume point needs, class 1
        a part only turn ends need, class 2 a whole node."""
        nodes = [n for n, _ in walk(self.tree)]
        # node -> tokens from its end down to the nearest leaf or branch point, and to the
        # nearest of those or a turn end
        reach: dict[TreeNode, int] = {}
        turn_reach: dict[TreeNode, int] = {}
        for node in reversed(nodes):  # children before parents
            kids = [c for c in node.children.values() if c.value is not None]
            if len(kids) == 1:
                reach[node] = len(kids[0].key) + reach[kids[0]]
                turn_reach[node] = 0 if node.turn_end else len(kids[0].key) + turn_reach[kids[0]]
            else:
                reach[node] = turn_reach[node] = 0
        out = []
        for node in nodes:
            if node.value is None or not node.window or node.window_lock:
                continue
            size = len(node.key)
            keep_turn, keep = self._keep(turn_reach[node]), self._keep(reach[node])
            if keep_turn < size:
                out.append((0, node.last_access, node.id, node, keep_turn))
            elif keep < size:
                out.append((1, node.last_access, node.id, node, keep))
            else:
                out.append((2, node.last_access, node.id, node, 0))
        out.sort(key=lambda c: c[:3])
        return out

    def _keep(self, reach: int) -> int:
        """Tokens of window KV a node keeps at its end when the nearest resume point below
        it is ``reach`` tokens down (whole pages)."""
        keep = max(0, self.window - 1 - reach)
        return -(-keep // self.page_size) * self.page_size

    def _tombstone(self, node: TreeNode) -> int:
        self.allocator.drop_windows(node.value)
        self.tree.set_window(node, False)
        size = len(node.key)
        self.window_size -= size
        self.tombstoned_tokens += size
        return size

    # ------------------------------------------------------------------ integrity
    def check(self, held: torch.Tensor | None) -> None:
        """Every device node's window flag agrees with the allocator, window locks lie on
        nodes with window KV and below their lock_ref, and the counters are right. Slots held
        by requests (``held``) always have their window pages."""
        size = locked = 0
        for node, _ in walk(self.tree):
            if node.value is None:
                _require(node.window_lock == 0, f"{node!r}: window-locked off the device")
                continue
            pages = self.allocator.has_windows(node.value)
            _require(bool((pages == node.window).all()), f"{node!r}: window flag is stale")
            _require(node.window_lock <= node.lock_ref, f"{node!r}: window lock above lock_ref")
            _require(node.window or not node.window_lock, f"{node!r}: a locked tombstone")
            if node.window:
                size += len(node.key)
                locked += len(node.key) if node.window_lock else 0
        _require(size == self.window_size, f"window size {self.window_size} != actual {size}")
        _require(locked == self.locked_size, f"window-locked {self.locked_size} != {locked}")
        if held is not None and held.numel():
            _require(bool(self.allocator.has_windows(held).all()), "a held slot lost its window")


def _require(condition: object, message: str) -> None:
    if not condition:
        raise AssertionError(message)
