"""Drafts from the cache: an n-gram index over the token sequences the radix tree holds.

The tree already holds every prompt and output it caches, as root-to-leaf paths per
namespace. ``NgramIndex`` is a tree listener (``cache/tree_listener.py``) that maps, per
namespace and per n-gram size, the hash of each n tokens along a path to the device node in
which they end (the most recently cached occurrence). It is kept in step with the tree: a
node is indexed when it enters the device (``on_cached``, ``on_loaded``), its entries move
with a split (``on_split``), and they go when it leaves the device (``on_leave_device``) or
the tree is reset. So it holds at most one entry per device token and n-gram size: its memory
is bounded by the KV pool, a small fraction of what the KV itself takes.

``CacheSource`` looks up the request's last n tokens (longest size first) in its own
namespace only (a draft never carries another tenant's text, not even as a guess), checks
the tokens (a hash is only a hint), measures how far back the match goes, and proposes what
follows along the tree: the rest of that node's edge, then the most recently used child,
down to ``limit`` tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from radixserve.cache import TreeListener, TreeNode
from radixserve.engine.drafts.source import MAX_MATCH, DraftSource, Proposal
from radixserve.engine.request import Request

NGRAM_SIZES = (8, 3)  # a longer n-gram is looked up first: its continuation is surer
_MULT = np.uint64(0x9E3779B97F4A7C15)


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """The hash of every ``n`` consecutive tokens of ``tokens`` (``len(tokens) - n + 1`` of
    them, as Python-int-sized uint64), the i-th ending at ``tokens[i + n - 1]``."""
    t = tokens.astype(np.uint64)
    if len(t) < n:
        return np.empty(0, np.uint64)
    h = np.zeros(len(t) - n + 1, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MULT + t[j : len(t) - n + 1 + j] + np.uint64(1)
    return h


def path_tail(node: TreeNode, end: int, m: int) -> np.ndarray:
    """The last ``m`` (or fewer, near the root) tokens of the path from the root to
    ``node.key[end - 1]`` inclusive."""
    pieces, have = [node.key[max(0, end - m) : end]], min(end, m)
    up = node.parent
    while have < m and up is not None and up.parent is not None:
        take = min(len(up.key), m - have)
        pieces.append(up.key[len(up.key) - take :])
        have += take
        up = up.parent
    return np.concatenate(pieces[::-1]) if len(pieces) > 1 else pieces[0]


class NgramIndex(TreeListener):
    """Per namespace and n-gram size: n-gram hash -> the device node its last token is in."""

    order = 3  # after the tiers' listener: hears a node arrive once it is settled

    def __init__(self, sizes: tuple[int, ...] = NGRAM_SIZES):
        self.sizes = sizes
        self.tables: dict[tuple[Any, int], dict[int, TreeNode]] = {}

    # ------------------------------------------------------------------ node hashes
    def _hashes(self, node: TreeNode, n: int, start: int = 0, stop: int | None = None) -> list:
        """The hashes of the n-grams ending at ``node.key[start:stop]`` (those that reach
        above the edge read the path above it)."""
        stop = len(node.key) if stop is None else stop
        if stop <= start:
            return []
        context = path_tail(node, stop, stop - start + n - 1)
        return ngram_hashes(context, n).tolist()[-(stop - start) :]

    def _add(self, node: TreeNode, start: int = 0, stop: int | None = None) -> None:
        """Index ``node.key[start:stop]``. Nothing follows a new leaf's last token yet, so
        that n-gram does not displace an earlier occurrence that has a continuation; it
        points at ``node`` once a child follows (``_followed``)."""
        leaf_end = not node.children and (stop is None or stop == len(node.key))
        for n in self.sizes:
            table = self.tables.setdefault((node.namespace, n), {})
            hashes = self._hashes(node, n, start, stop)
            if leaf_end and hashes:
                table.setdefault(hashes.pop(), node)
            table.update(dict.fromkeys(hashes, node))
        self._followed(node.parent)

    def _followed(self, node: TreeNode | None) -> None:
        """``node`` now has a child: its last n-grams have something after them."""
        if node is None or node.parent is None or node.value is None or not len(node.key):
            return
        for n in self.sizes:
            table = self.tables.get((node.namespace, n))
            last = self._hashes(node, n, len(node.key) - 1)
            if table is not None and last:
                table[last[0]] = node

    def _remove(self, node: TreeNode) -> None:
        for n in self.sizes:
            table = self.tables.get((node.namespace, n))
            if not table:
                continue
            for h in self._hashes(node, n):
                if table.get(h) is node:
                    del table[h]
            if not table:
                del self.tables[(node.namespace, n)]

    # ------------------------------------------------------------------ listener
    def on_cached(self, node: TreeNode) -> None:
        self._add(node)

    def on_loaded(self, node: TreeNode, window: bool) -> None:
        self._add(node)

    def on_split(self, upper: TreeNode, lower: TreeNode, n: int) -> None:
        # the n-grams that end in the first n tokens now end in ``upper``
        for size in self.sizes:
            table = self.tables.get((upper.namespace, size))
            if table:
                for h in self._hashes(upper, size):
                    if table.get(h) is lower:
                        table[h] = upper

    def on_leave_device(self, node: TreeNode) -> None:
        self._remove(node)

    def on_cleared(self) -> None:
        self.tables.clear()

    def check(self, held=None) -> None:
        for (_, n), table in self.tables.items():
            by_node: dict[TreeNode, list[int]] = {}
            for h, node in table.items():
                by_node.setdefault(node, []).append(h)
            for node, hashes in by_node.items():
                assert node.value is not None, f"index entry for off-device {node!r}"
                assert set(hashes) <= set(self._hashes(node, n)), f"stale entry for {node!r}"

    @property
    def num_entries(self) -> int:
        return sum(map(len, self.tables.values()))

    # ------------------------------------------------------------------ lookup
    def find(self, ids: np.ndarray, namespace: Any) -> tuple[TreeNode, int, int] | None:
        """Where the tree last holds ``ids``' last n tokens (longest size first), in
        ``namespace``: ``(node, end, match)`` with the match ending at ``node.key[end]`` and
        reaching ``match`` tokens back; None without one that has tokens after it."""
        for n in self.sizes:
            table = self.tables.get((namespace, n))
            if not table or len(ids) < n:
                continue
            node = table.get(ngram_hashes(ids[-n:], n).tolist()[0])
            if node is None:
                continue
            for end in np.flatnonzero(node.key == ids[-1])[::-1].tolist():
                if end + 1 == len(node.key) and not node.children:
                    continue  # nothing follows it
                if np.array_equal(path_tail(node, end + 1, n), ids[-n:]):
                    return node, end, self._match_len(node, end, ids)
        return None

    @staticmethod
    def _match_len(node: TreeNode, end: int, ids: np.ndarray) -> int:
        tail = path_tail(node, end + 1, min(MAX_MATCH, len(ids)))
        mine = ids[len(ids) - len(tail) :]
        differs = np.flatnonzero(tail[::-1] != mine[::-1])
        return int(differs[0]) if differs.size else len(tail)

    @staticmethod
    def continuation(node: TreeNode, end: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens after ``node.key[end]`` along the tree: the rest of the edge,
        then the most recently used child's, and so on."""
        out = node.key[end + 1 : end + 1 + limit].tolist()
        while len(out) < limit and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            out += node.key[: limit - len(out)].tolist()
        return out


class CacheSource(DraftSource):
    """What the prefix cache holds after the request's last tokens, in its namespace."""

    name = "cache"

    def __init__(self, index: NgramIndex):
        self.index = index

    def propose(self, req: Request, limit: int) -> Proposal | None:
        if limit <= 0:
            return None
        found = self.index.find(req.token_ids, req.namespace)
        if found is None:
            return None
        node, end, match = found
        tokens = self.index.continuation(node, end, limit)
        return Proposal(tokens, match) if tokens else None
