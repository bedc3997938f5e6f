"""Inspection of a RadixCache: the full integrity check and the summary behind ``/cache``.

Both walk the whole tree, so they are for tests, debugging and occasional requests, never
for the hot path. They read the cache's private state: this module is its friend.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.cache.base import EMPTY_INDICES, TreeSummary

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache, TreeNode


def walk(cache: RadixCache) -> Iterator[tuple[TreeNode, int]]:
    """Every non-root node with its depth in tokens (the length of its whole prefix)."""
    for root in cache._roots.values():
        stack = [(child, 0) for child in root.children.values()]
        while stack:
            node, depth = stack.pop()
            depth += len(node.key)
            yield node, depth
            stack.extend((c, depth) for c in node.children.values())


def tree_summary(cache: RadixCache, top: int = 10) -> TreeSummary:
    """Node count, cached tokens, and the longest prefixes that requests hit."""
    nodes = list(walk(cache))
    shared = sorted(
        (n for n in nodes if n[0].hit_count > 0), key=lambda n: (n[1], n[0].hit_count), reverse=True
    )
    top_prefixes = []
    for node, depth in shared[:top]:
        path, n = [], node
        while n.parent is not None:
            path.append(n.key)
            n = n.parent
        top_prefixes.append(
            {
                "prefix_tokens": depth,
                "hit_count": node.hit_count,
                "lock_ref": node.lock_ref,
                "head_token_ids": np.concatenate(path[::-1])[:16].tolist(),  # for display
                "namespace": repr(node.namespace),
            }
        )
    return TreeSummary(
        num_nodes=len(nodes), cached_tokens=cache.total_size(), top_prefixes=top_prefixes
    )


def check_tree(cache: RadixCache, held_indices: torch.Tensor | None = None) -> None:
    """Raise AssertionError unless every invariant of the tree and the pool holds."""
    p = cache.page_size
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    slot_runs: list[torch.Tensor] = []
    for ns, root in cache._roots.items():
        _require(root.namespace == ns and root.parent is None, "bad namespace root")
        _require(root.children or ns is None, f"empty namespace root {ns!r} kept")
    for node, _ in walk(cache):
        size = len(node.key)
        _require(
            node.parent.children.get(cache._child_key(node.key)) is node,
            f"{node!r} is not its parent's child under its first key",
        )
        _require(
            size > 0 and size % p == 0 and len(node.value) == size,
            f"{node!r}: edge of {size} tokens, {len(node.value)} slots, page {p}",
        )
        child_locks = sum(c.lock_ref for c in node.children.values())
        _require(node.lock_ref >= child_locks >= 0, f"{node!r}: lock below its children's")
        if node.lock_ref == 0:
            evictable += size
            if not node.children:
                leaves.add(node)
        else:
            protected += size
        if cache.events is not None:
            cache._hasher.check(node)
        slot_runs.append(node.value)
    _require(
        evictable == cache._evictable_size,
        f"evictable size {cache._evictable_size} != actual {evictable}",
    )
    _require(
        protected == cache._protected_size,
        f"protected size {cache._protected_size} != actual {protected}",
    )
    _require(leaves == cache._evictable_leaves, "evictable-leaf set is stale")
    _require(
        leaves <= cache._heap.live_nodes(cache._is_evictable_leaf),
        "an evictable leaf has no live heap entry",
    )
    slots = torch.cat(slot_runs) if slot_runs else EMPTY_INDICES
    _require(torch.unique(slots).numel() == slots.numel(), "a slot is cached twice")
    if p > 1 and slots.numel():
        runs = slots.view(-1, p)
        _require(bool((runs[:, 0] % p == 0).all()), "a cached page does not start a page")
        _require(bool((runs.diff(dim=1) == 1).all()), "a cached page is not contiguous")
    cache.allocator.check(slots, held_indices)


def _require(condition: Any, message: str) -> None:
    if not condition:
        raise AssertionError(message)
