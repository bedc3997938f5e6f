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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from radixserve.cache.tree_node import TreeNode
from radixserve.kvevents.hashing import chain_block_hashes, namespace_salt
from radixserve.kvevents.types import BlockRemoved, BlockStored


class TreeEvents:
    """Hashes and events of one tree: ``roots`` lists its namespace roots, ``medium`` names
    the tier a node's KV is on (for the events that announce it)."""

    def __init__(
        self,
        page_size: int,
        block_size: int,
        roots: Callable[[], Iterable[TreeNode]],
        medium: Callable[[TreeNode], str],
    ):
        if block_size < 1 or block_size % page_size:
            raise ValueError(
                f"the KV event block size ({block_size}) must be a positive multiple of the "
                f"page size ({page_size})"
            )
        self.block_size = block_size
        self._roots = roots
        self._medium = medium

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

    def _block_tokens(self, node: TreeNode, count: int) -> np.ndarray:
        """The tokens of the ``count`` blocks ``node`` owns (a straddling first block starts
        above its edge)."""
        head = node.offset % self.block_size  # tokens of the first block above this edge
        tokens = node.key[: count * self.block_size - head]
        if head:
            tokens = np.concatenate([self._tokens_above(node, head), tokens])
        return tokens

    def _stored_event(
        self, node: TreeNode, tokens: np.ndarray, parent_hash: int | None, medium: str
    ) -> BlockStored:
        return BlockStored(node.page_hashes, parent_hash, tokens.tolist(), self.block_size,
                           node.namespace, medium)  # fmt: skip

    def removed(self, node: TreeNode) -> BlockRemoved | None:
        if not node.page_hashes:
            return None
        return BlockRemoved(node.page_hashes, node.namespace, self._medium(node))

    def split(self, mid: TreeNode, child: TreeNode, n: int) -> None:
        """``mid`` is the upper ``n`` tokens cut from ``child``, which keeps the rest."""
        mid.offset = child.offset
        cut = self.owned(child.offset, n)
        mid.page_hashes, child.page_hashes = child.page_hashes[:cut], child.page_hashes[cut:]
        child.offset = mid.offset + n

    def snapshot(self) -> list[BlockStored]:
        events = []
        for root in self._roots():
            root.offset, root.page_hashes = 0, []
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                event = self.hash_node(node)
                if event is not None:
                    events.append(event)
                stack.extend(node.children.values())
        return events

    def check(self, node: TreeNode) -> None:
        if node.offset != node.parent.offset + len(node.parent.key):
            raise AssertionError(f"{node!r}: event offset {node.offset} is stale")
        if len(node.page_hashes) != self.owned(node.offset, len(node.key)):
            raise AssertionError(f"{node!r}: block hashes lost")
