"""Inspection of a RadixCache: the full integrity checks and the summary behind ``/cache``.

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
    from radixserve.cache.tiered_cache import TieredRadixCache


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
        _require(size > 0 and size % p == 0, f"{node!r}: edge of {size} tokens, page {p}")
        child_locks = sum(c.lock_ref for c in node.children.values())
        _require(node.lock_ref >= child_locks >= 0, f"{node!r}: lock below its children's")
        if cache.events is not None:
            cache._hasher.check(node)
        if node.value is None:  # off the device (a tiered cache checks its other tiers)
            _require(node.lock_ref == 0, f"{node!r}: locked but not on the device")
            continue
        _require(len(node.value) == size, f"{node!r}: {size} tokens but {len(node.value)} slots")
        _require(
            node.parent.parent is None or node.parent.value is not None,
            f"{node!r} is on the device below a node that is not",
        )
        if node.lock_ref == 0:
            evictable += size
            if cache._is_leaf(node):
                leaves.add(node)
        else:
            protected += size
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
    slots = _check_runs(slot_runs, p, "device")
    cache.allocator.check(slots, held_indices)


def check_host_tier(cache: TieredRadixCache, held_host: torch.Tensor) -> None:
    """The host side of a tiered cache: every node on some tier, host sizes and leaves right,
    host slots in whole pages, none cached twice; free + cached + held == the host pool."""
    p = cache.page_size
    size = 0
    runs: list[torch.Tensor] = []
    leaves = set()
    for node, _ in walk(cache):
        on_host = node.host_value is not None
        _require(node.value is not None or on_host, f"{node!r} is on no tier")
        if on_host:
            _require(len(node.host_value) == len(node.key), f"{node!r}: host run of wrong size")
            runs.append(node.host_value)
            size += len(node.key)
        if node.value is None and not node.children:
            leaves.add(node)
        if node.storage_keys is not None:
            _require(len(node.storage_keys) == len(node.key) // p, f"{node!r}: storage keys lost")
    _require(size == cache._host_size, f"host size {cache._host_size} != actual {size}")
    _require(leaves == cache._host_leaves, "host-leaf set is stale")
    live = cache._host_heap.live_nodes(cache._host_leaves.__contains__)
    _require(leaves <= live, "a host leaf has no live heap entry")
    cache.host.check(_check_runs(runs, p, "host"), held_host)


def _check_runs(runs: list[torch.Tensor], p: int, tier: str) -> torch.Tensor:
    """All cached slots of one pool, checked: none twice, whole contiguous pages."""
    slots = torch.cat(runs) if runs else EMPTY_INDICES
    _require(torch.unique(slots).numel() == slots.numel(), f"a {tier} slot is cached twice")
    if p > 1 and slots.numel():
        pages = slots.view(-1, p)
        _require(bool((pages[:, 0] % p == 0).all()), f"a cached {tier} page does not start a page")
        _require(bool((pages.diff(dim=1) == 1).all()), f"a cached {tier} page is not contiguous")
    return slots


def _require(condition: Any, message: str) -> None:
    if not condition:
        raise AssertionError(message)
