"""Eviction order for the radix tree: policies by name and a lazy heap of evictable leaves.

A policy maps a node to a priority tuple; the evictable leaf with the smallest is evicted
first. The heap holds ``(priority, node id, node)`` entries and is never searched: an entry is
valid while its node is still an evictable leaf and its priority is unchanged; stale entries
are skipped on pop, and the heap is rebuilt from the live leaves once stale ones outnumber them
(amortised O(log n)).

Every priority change must re-push the node, or the heap would pop in a wrong order. Changes
come from three places:

- events on the node (a match touches it, a request hits it, it becomes a leaf): the cache
  pushes it;
- a policy's own bookkeeping (SLRU demotes a protected node): the policy returns the nodes it
  changed from ``on_hit`` and the heap re-pushes them;
- the passing of time with no event on the node at all (a reuse rate falls as requests are
  admitted elsewhere; an oracle's next use goes by). A policy names the exact admission count
  at which a node's priority will next change (``changes_at``); the heap keeps a second
  min-heap of those moments and re-pushes the nodes whose moment has come before every pop.

Time is the cache's admission counter (requests admitted so far), read through ``clock``.

Policies (``make_policy``): ``lru``; ``lfu``; ``slru`` (new nodes on probation, promoted on
their first reuse, the protected segment capped at a share of the cached tokens: the least
recently used protected node beyond it is demoted to the head of probation); ``cost-aware``
(GDSF: ``L + (hits + 1) x recompute cost per token``, the cost growing with the node's depth
as attention does, ``L`` rising to each evicted node's value so old favourites age out); and
any of them under ``cache_threshold R``: a node whose reuse rate (hits per request admitted
since it was cached) is below ``R`` goes before every node at or above it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

from radixserve.cache.eviction_base import EvictableNode, EvictionPolicy, EvictionStats
from radixserve.cache.eviction_odds import ReturnOddsPolicy
from radixserve.cache.eviction_reuse import ReusePolicy

# Per-token prefill cost grows linearly with context: cost(depth) ~ 1 + depth / SCALE. SCALE is
# the context length at which attention doubles a token's cost; measured on this engine's CPU
# timing profile (radixserve/sim/profiles/), where it is a few thousand tokens.
COST_CONTEXT_SCALE = 4096.0
SLRU_PROTECTED_SHARE = 0.8


class FunctionPolicy(EvictionPolicy):
    """A stateless priority function of the node alone."""

    def __init__(self, name: str, fn: Callable[[Any], tuple]):
        self.name, self._fn = name, fn

    def priority(self, node: Any, now: int) -> tuple:
        return self._fn(node)


def lru_priority(node: EvictableNode) -> tuple[int, ...]:
    return (node.last_access,)


def lfu_priority(node: EvictableNode) -> tuple[int, ...]:
    # Least frequently hit first; among equals, least recently used.
    return (node.hit_count, node.last_access)


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU. ``policy_state`` is ``(protected, probation recency)``; a demoted node's
    recency is the touch clock at demotion, so it joins probation as its most recent member."""

    name = "slru"

    def __init__(self, share: float = SLRU_PROTECTED_SHARE):
        self.share = share
        self.total_tokens: Callable[[], int] = int
        self.touch_clock: Callable[[], int] = int
        self.protected_tokens = 0
        self._protected: dict[int, Any] = {}
        self._lru: list[tuple[int, int, Any]] = []  # protected nodes by last access (lazy)

    def priority(self, node: Any, now: int) -> tuple:
        protected, since = node.policy_state or (False, 0)
        return (1, node.last_access) if protected else (0, max(node.last_access, since))

    def bind(self, total_tokens: Callable[[], int], touch_clock: Callable[[], int]) -> None:
        self.total_tokens, self.touch_clock = total_tokens, touch_clock

    def _protect(self, node: Any) -> None:
        node.policy_state = (True, 0)
        self.protected_tokens += len(node.key)
        self._protected[node.id] = node
        heapq.heappush(self._lru, (node.last_access, node.id, node))

    def on_hit(self, node: Any, now: int) -> Iterable[Any]:
        n = node
        while n is not None and n.parent is not None:
            if n.id not in self._protected:
                self._protect(n)
            n = n.parent
        if len(self._lru) > 2 * len(self._protected) + 64:
            self._lru = [(n.last_access, i, n) for i, n in self._protected.items()]
            heapq.heapify(self._lru)
        return self._demote(self.share * self.total_tokens())

    def _demote(self, cap: float) -> list[Any]:
        demoted = []
        while self.protected_tokens > cap and self._lru:
            access, i, n = heapq.heappop(self._lru)
            if self._protected.get(i) is not n:
                continue  # demoted or evicted since
            if access != n.last_access:  # touched since: keys only grow, so re-file it
                heapq.heappush(self._lru, (n.last_access, i, n))
                continue
            del self._protected[i]
            n.policy_state = (False, self.touch_clock())
            self.protected_tokens -= len(n.key)
            demoted.append(n)
        return demoted

    def on_split(self, upper: Any, lower: Any) -> None:
        if lower.id in self._protected:  # both halves stay protected; the total is unchanged
            self._protected[upper.id] = upper
            heapq.heappush(self._lru, (upper.last_access, upper.id, upper))

    def on_evict(self, node: Any, priority: tuple) -> None:
        if self._protected.pop(node.id, None) is not None:
            self.protected_tokens -= len(node.key)


class CostAwarePolicy(EvictionPolicy):
    """GDSF: value ``L + (hits + 1) x cost per token``, fixed when the node is cached or hit.

    The node's cost is the prefill of its tokens over their contexts; divided by its size that
    is the per-token cost at the edge's mean depth. ``L`` is the value of the last evicted
    node, so a node hit long ago is eventually worth less than one cached just now.
    """

    name = "cost-aware"

    def __init__(self, context_scale: float = COST_CONTEXT_SCALE):
        self.context_scale = context_scale
        self.inflation = 0.0

    def _value(self, node: Any) -> float:
        mean_depth = node.depth - len(node.key) / 2
        return self.inflation + (node.hit_count + 1) * (1.0 + mean_depth / self.context_scale)

    def priority(self, node: Any, now: int) -> tuple:
        if node.policy_state is None:
            node.policy_state = self._value(node)
        return (node.policy_state, node.last_access)

    def on_hit(self, node: Any, now: int) -> Iterable[Any]:
        n = node
        while n is not None and n.parent is not None:
            n.policy_state = self._value(n)
            n = n.parent
        return ()

    def on_evict(self, node: Any, priority: tuple) -> None:
        self.inflation = max(self.inflation, priority[0])


class ThresholdPolicy(EvictionPolicy):
    """Nodes reused less than ``threshold`` times per admitted request go first.

    A node cached at admission count ``c`` with ``h`` hits has, at count ``A``, the reuse rate
    ``h / (A - c)``; it is below ``R = p/q`` exactly when ``h*q < p*(A - c)``. Between its own
    hits that first holds at ``A* = c + floor(h*q/p) + 1``: a constant, so the heap is told
    that moment and re-pushes the node then, with no approximation.
    """

    def __init__(self, base: EvictionPolicy, threshold: float):
        self.base = base
        self.threshold = Fraction(str(threshold)).limit_denominator(10**6)
        self.name = f"{base.name}+threshold={threshold:g}"

    def _crossing(self, node: Any) -> int:
        p, q = self.threshold.numerator, self.threshold.denominator
        return node.created + node.hit_count * q // p + 1

    def priority(self, node: Any, now: int) -> tuple:
        return (int(now < self._crossing(node)), *self.base.priority(node, now))

    def changes_at(self, node: Any, now: int) -> int | None:
        crossing = self._crossing(node)
        base = self.base.changes_at(node, now)
        if crossing > now:
            return crossing if base is None else min(crossing, base)
        return base

    def bind(self, total_tokens: Callable[[], int], touch_clock: Callable[[], int]) -> None:
        self.base.bind(total_tokens, touch_clock)

    def on_hit(self, node: Any, now: int) -> Iterable[Any]:
        return self.base.on_hit(node, now)

    def on_split(self, upper: Any, lower: Any) -> None:
        self.base.on_split(upper, lower)

    def on_evict(self, node: Any, priority: tuple) -> None:
        self.base.on_evict(node, priority[1:])

    def stats(self) -> EvictionStats | None:
        return self.base.stats()


EVICTION_POLICIES = ("lru", "lfu", "slru", "cost-aware", "return-odds", "reuse")


def make_policy(name: str, cache_threshold: float | None = None) -> EvictionPolicy:
    """A fresh policy (policies keep state); the tree binds it (``EvictionPolicy.bind``)."""
    if name == "lru":
        policy: EvictionPolicy = FunctionPolicy(name, lru_priority)
    elif name == "lfu":
        policy = FunctionPolicy(name, lfu_priority)
    elif name == "slru":
        policy = SLRUPolicy()
    elif name == "cost-aware":
        policy = CostAwarePolicy()
    elif name == "return-odds":
        policy = ReturnOddsPolicy()
    elif name == "reuse":
        policy = ReusePolicy()
    else:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {EVICTION_POLICIES}")
    if cache_threshold is not None:
        check_cache_threshold(cache_threshold)
        policy = ThresholdPolicy(policy, cache_threshold)
    return policy


def check_cache_threshold(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"cache_threshold must be in (0, 1] (hits per request), got {value!r}")


class LeafHeap:
    """Min-heap over the evictable leaves; validity is decided by the caller's ``is_live``."""

    def __init__(
        self, policy: EvictionPolicy | Callable[[Any], tuple], clock: Callable[[], int] = int
    ):
        if not isinstance(policy, EvictionPolicy):
            policy = FunctionPolicy(getattr(policy, "__name__", "custom"), policy)
        self.policy = policy
        self.clock = clock
        self._heap: list[tuple[tuple, int, Any]] = []
        self._wake: list[tuple[int, int, Any]] = []  # (admission count, node id, node)

    def priority(self, node: Any) -> tuple:
        return self.policy.priority(node, self.clock())

    def push(self, node: Any) -> None:
        now = self.clock()
        heapq.heappush(self._heap, (self.policy.priority(node, now), node.id, node))
        when = self.policy.changes_at(node, now)
        if when is not None:
            heapq.heappush(self._wake, (when, node.id, node))

    def note_hit(self, node: Any, is_live: Callable[[Any], bool]) -> None:
        for changed in self.policy.on_hit(node, self.clock()):
            if is_live(changed):
                self.push(changed)

    def note_split(self, upper: Any, lower: Any) -> None:
        self.policy.on_split(upper, lower)

    def _wake_up(self, is_live: Callable[[Any], bool]) -> None:
        now = self.clock()
        while self._wake and self._wake[0][0] <= now:
            _, _, node = heapq.heappop(self._wake)
            if is_live(node):
                self.push(node)

    def pop(self, is_live: Callable[[Any], bool]) -> Any | None:
        self._wake_up(is_live)
        now = self.clock()
        while self._heap:
            prio, _, node = heapq.heappop(self._heap)
            if is_live(node) and prio == self.policy.priority(node, now):
                self.policy.on_evict(node, prio)
                return node
        return None

    def maybe_compact(self, live_leaves: Iterable[Any], num_live: int) -> None:
        if len(self._heap) > 2 * num_live + 64 or len(self._wake) > 2 * num_live + 64:
            self.rebuild(live_leaves)

    def rebuild(self, live_leaves: Iterable[Any]) -> None:
        self._heap, self._wake = [], []
        for node in list(live_leaves):
            self.push(node)

    def live_nodes(self, is_live: Callable[[Any], bool]) -> set[Any]:
        """Nodes with a valid entry (after due wake-ups): every evictable leaf must be one."""
        self._wake_up(is_live)
        now = self.clock()
        return {
            n for prio, _, n in self._heap if is_live(n) and prio == self.policy.priority(n, now)
        }

    def __len__(self) -> int:
        return len(self._heap)
