"""Block hashes for the radix tree's KV events: which blocks each node owns, and their names.

Events name KV in blocks of ``block_size`` tokens aligned to the sequence start (16 by
default, a multiple of the page size), while tree edges split anywhere on a page boundary. So
a block may straddle two nodes. Rule: a block belongs to the node holding its LAST token.
Then a node owns ``(offset + len) // B - offset // B`` blocks, where ``offset`` is the number
of tokens above its edge; evicting a leaf removes exactly the blocks it owns (every block it
owns ends inside it), and a split hands the blocks ending above the cut to the upper node, so
a split changes no block and emits nothing.

A node's hashes need the hash of the block before its first owned block (the last hash owned
by the nearest ancestor owning any: at most ``B`` tokens up) and, for a straddling block, the
last few tokens above its edge (fewer than ``B``). Both walks are bounded by ``B`` tokens.

``snapshot`` (re)computes every node's offset and hashes, parents first, and returns one
``BlockStored`` per node owning blocks: the whole tree as events, for a subscriber that joins
late and for switching events on while the tree already holds pages.

Window-less blocks (a model with sliding-window layers, ``window_tree.py``; the medium in
``kvevents/types.py``): a device block is window-less when any of its tokens lies in a
tombstone. Of the blocks a device node owns, those are a leading run: all of them for a
tombstone, else at most the first, when it straddles a tombstone above the node's edge
(``windowless_count``). So a node's window flag decides its own blocks and the one block
straddling its end, owned by a device node below it in each branch (``set_window`` announces
the difference before and after). A node announces its window-less blocks after its device
blocks and withdraws them before (``windowless``); ``snapshot`` includes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from radixserve.cache.tree_node import TreeNode
from radixserve.kvevents.hashing import chain_block_hashes, namespace_salt
from radixserve.kvevents.types import BlockRemoved, BlockStored, windowless_medium


class TreeEvents:
    """Hashes and events of one tree: ``roots`` lists its namespace roots, ``medium`` names
    the tier a node's KV is on (for the events that announce it), ``window`` is the sliding
    window of a tree whose nodes may be tombstones (None: no window layers kept apart)."""

    def __init__(
        self,
        page_size: int,
        block_size: int,
        roots: Callable[[], Iterable[TreeNode]],
        medium: Callable[[TreeNode], str],
        window: int | None = None,
    ):
        if block_size < 1 or block_size % page_size:
            raise ValueError(
                f"the KV event block size ({block_size}) must be a positive multiple of the "
                f"page size ({page_size})"
            )
        self.block_size = block_size
        self._roots = roots
        self._medium = medium
        self.windowless_medium = windowless_medium(window) if window else None

    def owned(self, offset: int, length: int) -> int:
        b = self.block_size
        return (offset + length) // b - offset // b

    def _parent_hash(self, node: TreeNode) -> int | None:
        n = node.parent
        while n is not None and not n.page_hashes:
            n = n.parent
        return n.page_hashes[-1] if n is not None else None

    def _tokens_above(self, node: TreeNode, count: int) -> np.ndarray:
        parts, n = [], node.parent
        while count > 0 and n is not None:
            take = min(count, len(n.key))
            parts.append(n.key[len(n.key) - take :])
            count -= take
            n = n.parent
        return np.concatenate(parts[::-1]) if parts else np.empty(0, np.int32)

    def hash_node(self, node: TreeNode) -> BlockStored | None:
        """Set ``node.page_hashes`` (its parent's offset and hashes being current) and return
        the event that stores them, or None when the node owns no whole block."""
        node.offset = node.parent.offset + len(node.parent.key)
        count = self.owned(node.offset, len(node.key))
        if count == 0:
            node.page_hashes = []
            return None
        tokens, parent_hash = self._block_tokens(node, count), self._parent_hash(node)
        salt = namespace_salt(node.namespace)
        node.page_hashes = chain_block_hashes(parent_hash, tokens, self.block_size, salt=salt)
        return self._stored_event(node, tokens, parent_hash, self._medium(node))

    def stored(self, node: TreeNode, medium: str) -> BlockStored | None:
        """The event storing ``node``'s blocks on ``medium`` from the hashes it holds (current
        while events are on): a tier move announces them again without hashing."""
        if not node.page_hashes:
            return None
        tokens = self._block_tokens(node, len(node.page_hashes))
        return self._stored_event(node, tokens, self._parent_hash(node), medium)

    def _block_tokens(self, node: TreeNode, stop: int, start: int = 0) -> np.ndarray:
        """The tokens of blocks ``start`` to ``stop`` of those ``node`` owns (a straddling
        first block starts above its edge)."""
        head = node.offset % self.block_size  # tokens of the first block above this edge
        begin = start * self.block_size - head
        tokens = node.key[max(begin, 0) : stop * self.block_size - head]
        if begin < 0:
            tokens = np.concatenate([self._tokens_above(node, head), tokens])
        return tokens

    def _stored_event(
        self,
        node: TreeNode,
        tokens: np.ndarray,
        parent_hash: int | None,
        medium: str,
        hashes: list[int] | None = None,
    ) -> BlockStored:
        hashes = node.page_hashes if hashes is None else hashes
        return BlockStored(hashes, parent_hash, tokens.tolist(), self.block_size,
                           node.namespace, medium)  # fmt: skip

    def split(self, mid: TreeNode, child: TreeNode, n: int) -> None:
        """``mid`` is the upper ``n`` tokens cut from ``child``, which keeps the rest."""
        mid.offset = child.offset
        cut = self.owned(child.offset, n)
        mid.page_hashes, child.page_hashes = child.page_hashes[:cut], child.page_hashes[cut:]
        child.offset = mid.offset + n

    # ------------------------------------------------------------------ window-less blocks
    def windowless_count(self, node: TreeNode) -> int:
        """How many of the blocks ``node`` owns are window-less (a leading run; 0 off the
        device or without window layers)."""
        count = len(node.page_hashes)
        if self.windowless_medium is None or node.value is None or not count:
            return 0
        if not node.window:
            return count
        head, above = node.offset % self.block_size, node.parent
        while head > 0 and above.parent is not None:
            if not above.window:
                return 1
            head -= len(above.key)
            above = above.parent
        return 0

    def windowless(self, node: TreeNode, arriving: bool) -> BlockStored | BlockRemoved | None:
        """Announce ``node``'s window-less blocks once its device blocks are announced
        (``arriving``), or withdraw them before its device blocks leave."""
        count = self.windowless_count(node)
        return self._window_event(node, *((0, count) if arriving else (count, 0)))

    def set_window(self, node: TreeNode, window: bool) -> list[BlockStored | BlockRemoved]:
        """Set ``node.window`` (a device node); the events of the blocks that become
        window-less, or whole again, with it."""
        owners = [node, *self._straddling_owners(node)]
        before = [self.windowless_count(n) for n in owners]
        node.window = window
        events = [self._window_event(n, b, self.windowless_count(n))
                  for n, b in zip(owners, before, strict=True)]  # fmt: skip
        return [e for e in events if e is not None]

    def _straddling_owners(self, node: TreeNode) -> list[TreeNode]:
        """The device nodes below ``node`` owning the block that straddles its end (one per
        branch; none when its end is a block boundary)."""
        end = node.offset + len(node.key)
        if end % self.block_size == 0:
            return []
        last = end - end % self.block_size + self.block_size  # the block's end
        out, stack = [], list(node.children.values())
        while stack:
            child = stack.pop()
            if child.value is None:
                continue
            if child.offset + len(child.key) >= last:
                out.append(child)
            else:
                stack.extend(child.children.values())
        return out

    def _window_event(
        self, node: TreeNode, before: int, after: int
    ) -> BlockStored | BlockRemoved | None:
        """The event taking ``node``'s window-less run of blocks from ``before`` to ``after``."""
        if before == after:
            return None
        lo, hi = min(before, after), max(before, after)
        hashes = node.page_hashes[lo:hi]
        if after < before:
            return BlockRemoved(hashes, node.namespace, self.windowless_medium)
        parent = node.page_hashes[lo - 1] if lo else self._parent_hash(node)
        tokens = self._block_tokens(node, hi, lo)
        return self._stored_event(node, tokens, parent, self.windowless_medium, hashes)

    # ------------------------------------------------------------------ whole tree
    def snapshot(self) -> list[BlockStored]:
        events = []
        for root in self._roots():
            root.offset, root.page_hashes = 0, []
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                for event in (self.hash_node(node), self.windowless(node, arriving=True)):
                    if event is not None:
                        events.append(event)
                stack.extend(node.children.values())
        return events

    def check(self, node: TreeNode) -> None:
        if node.offset != node.parent.offset + len(node.parent.key):
            raise AssertionError(f"{node!r}: event offset {node.offset} is stale")
        if len(node.page_hashes) != self.owned(node.offset, len(node.key)):
            raise AssertionError(f"{node!r}: block hashes lost")
