"""Inspection of a radix tree: the full integrity checks and the summary behind ``/cache``.

Both walk the whole tree, so they are for tests, debugging and occasional requests, never
for the hot path. They read only what the tree hands out: ``TreeState`` (its bookkeeping,
from ``RadixCache.integrity_state``) and its nodes' public fields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from radixserve.cache.base import EMPTY_INDICES, TreeSummary
from radixserve.cache.tree_node import TreeNode


class _Walkable(Protocol):
    def roots(self) -> Iterable[TreeNode]: ...


@dataclass
class TreeState:
    """What a tree keeps about its nodes, as the checks compare it with the nodes themselves.

    The ``*_live`` sets are the leaves with a valid entry in each eviction heap; ``is_leaf``
    says whether nothing below a node is on the device."""

    roots: dict[Any, TreeNode]
    page_size: int
    evictable_size: int
    protected_size: int
    evictable_leaves: set[TreeNode]
    evictable_live: set[TreeNode]
    host_size: int
    host_leaves: set[TreeNode]
    host_live: set[TreeNode]
    is_leaf: Callable[[TreeNode], bool]
    child_key: Callable[[np.ndarray], Any]


def walk(tree: _Walkable) -> Iterator[tuple[TreeNode, int]]:
    """Every non-root node with its depth in tokens (the length of its whole prefix)."""
    for root in tree.roots():
        stack = [(child, 0) for child in root.children.values()]
        while stack:
            node, depth = stack.pop()
            depth += len(node.key)
            yield node, depth
            stack.extend((c, depth) for c in node.children.values())


def tree_summary(tree: _Walkable, cached_tokens: int, top: int = 10) -> TreeSummary:
    """Node count, cached tokens, and the longest prefixes that requests hit."""
    nodes = list(walk(tree))
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
    return TreeSummary(num_nodes=len(nodes), cached_tokens=cached_tokens, top_prefixes=top_prefixes)


def check_tree(tree: _Walkable, state: TreeState) -> torch.Tensor:
    """Raise AssertionError unless every invariant of the tree's device side holds; return
    the device slots it caches (checked: none twice, whole pages)."""
    p = state.page_size
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    slot_runs: list[torch.Tensor] = []
    for ns, root in state.roots.items():
        _require(root.namespace == ns and root.parent is None, "bad namespace root")
        _require(root.children or ns is None, f"empty namespace root {ns!r} kept")
    for node, _ in walk(tree):
        size = len(node.key)
        _require(
            node.parent.children.get(state.child_key(node.key)) is node,
            f"{node!r} is not its parent's child under its first key",
        )
        _require(size > 0 and size % p == 0, f"{node!r}: edge of {size} tokens, page {p}")
        child_locks = sum(c.lock_ref for c in node.children.values())
        _require(node.lock_ref >= child_locks >= 0, f"{node!r}: lock below its children's")
        if node.value is None:  # off the device (check_host_tier checks its other tier)
            _require(node.lock_ref == 0, f"{node!r}: locked but not on the device")
            continue
        _require(len(node.value) == size, f"{node!r}: {size} tokens but {len(node.value)} slots")
        _require(
            node.parent.parent is None or node.parent.value is not None,
            f"{node!r} is on the device below a node that is not",
        )
        if node.lock_ref == 0:
            evictable += size
            if state.is_leaf(node):
                leaves.add(node)
        else:
            protected += size
        slot_runs.append(node.value)
    _require(
        evictable == state.evictable_size,
        f"evictable size {state.evictable_size} != actual {evictable}",
    )
    _require(
        protected == state.protected_size,
        f"protected size {state.protected_size} != actual {protected}",
    )
    _require(leaves == state.evictable_leaves, "evictable-leaf set is stale")
    _require(leaves <= state.evictable_live, "an evictable leaf has no live heap entry")
    return _check_runs(slot_runs, p, "device")


def check_host_tier(tree: _Walkable, state: TreeState) -> torch.Tensor:
    """The host side: every node on some tier, host sizes and leaves right; return the host
    slots cached (checked: none twice, whole pages)."""
    p = state.page_size
    size = 0
    runs: list[torch.Tensor] = []
    leaves = set()
    for node, _ in walk(tree):
        on_host = node.host_value is not None
        _require(node.value is not None or on_host, f"{node!r} is on no tier")
        if on_host:
            _require(len(node.host_value) == len(node.key), f"{node!r}: host run of wrong size")
            runs.append(node.host_value)
            size += len(node.key)
        if node.value is None and not node.children:
            leaves.add(node)
    _require(size == state.host_size, f"host size {state.host_size} != actual {size}")
    _require(leaves == state.host_leaves, "host-leaf set is stale")
    _require(leaves <= state.host_live, "a host leaf has no live heap entry")
    return _check_runs(runs, p, "host")


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
