"""Eviction order for the radix tree: policies by name and a lazy heap of evictable leaves.

A policy maps a node to a priority tuple; the smallest is evicted first. The heap holds
(priority, node id, node) entries and is never searched: an entry is valid while its node is
still an evictable leaf and its priority is unchanged; stale entries are skipped on pop, and
the heap is rebuilt from the live leaves once stale ones outnumber them (amortised O(log n)).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any, Protocol


class EvictableNode(Protocol):
    id: int
    last_access: int
    hit_count: int


def lru_priority(node: EvictableNode) -> tuple[int, ...]:
    return (node.last_access,)


def lfu_priority(node: EvictableNode) -> tuple[int, ...]:
    # Least frequently hit first; among equals, least recently used.
    return (node.hit_count, node.last_access)


EVICTION_POLICIES: dict[str, Callable[[EvictableNode], tuple[int, ...]]] = {
    "lru": lru_priority,
    "lfu": lfu_priority,
}


def get_eviction_policy(name: str) -> Callable[[EvictableNode], tuple[int, ...]]:
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None


class LeafHeap:
    """Min-heap over the evictable leaves; validity is decided by the caller's ``is_live``."""

    def __init__(self, priority: Callable[[Any], tuple[int, ...]]):
        self.priority = priority
        self._heap: list[tuple[tuple[int, ...], int, Any]] = []

    def push(self, node: Any) -> None:
        heapq.heappush(self._heap, (self.priority(node), node.id, node))

    def pop(self, is_live: Callable[[Any], bool]) -> Any | None:
        while self._heap:
            prio, _, node = heapq.heappop(self._heap)
            if is_live(node) and prio == self.priority(node):
                return node
        return None

    def maybe_compact(self, live_leaves: Iterable[Any], num_live: int) -> None:
        if len(self._heap) > 2 * num_live + 64:
            self.rebuild(live_leaves)

    def rebuild(self, live_leaves: Iterable[Any]) -> None:
        self._heap = [(self.priority(n), n.id, n) for n in live_leaves]
        heapq.heapify(self._heap)

    def live_nodes(self, is_live: Callable[[Any], bool]) -> set[Any]:
        return {n for prio, _, n in self._heap if is_live(n) and prio == self.priority(n)}

    def __len__(self) -> int:
        return len(self._heap)
