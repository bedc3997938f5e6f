"""The interface of an eviction policy: what it may read of a tree node and the hooks the tree
calls. ``eviction`` holds the policies and the heap; a policy in its own module (``eviction_odds``)
builds on this one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol


class EvictableNode(Protocol):
    id: int
    parent: Any
    key: Any
    last_access: int
    hit_count: int
    depth: int  # tokens from the root to the end of this node's edge
    created: int  # admission count when the node was cached
    policy_state: Any  # owned by the policy; None until it first sees the node


@dataclass
class EvictionStats:
    """What a predicting policy expected of the leaves it evicted and what became of them
    (monotonic counters, except the last two).

    ``predicted_returns / evicted_leaves`` is the mean chance it gave an evicted leaf of being
    used again within the horizon; ``returned_leaves / evicted_leaves`` is how often one was
    (a request cached the same prefix again below the same parent), ``returned_tokens`` what
    that cost in recomputed tokens. ``reused_leaves`` counts ranked leaves used again while
    cached."""

    policy: str
    evicted_leaves: int = 0
    predicted_returns: float = 0.0
    returned_leaves: int = 0
    returned_tokens: int = 0
    reused_leaves: int = 0
    horizon: int = 0  # touches of the tree within which a use counts as a return
    eviction_age: float = 0.0  # mean idle age of evicted leaves, in touches


class EvictionPolicy:
    """How evictable leaves are ordered. Subclasses override ``priority`` and maybe hooks."""

    name = "base"

    def bind(self, total_tokens: Callable[[], int], touch_clock: Callable[[], int]) -> None:
        """The tree this policy serves, once, before it ranks anything: its size in tokens
        and its touch clock (the counter behind ``last_access``)."""

    def priority(self, node: Any, now: int) -> tuple:
        raise NotImplementedError

    def changes_at(self, node: Any, now: int) -> int | None:
        """The admission count at which ``priority(node)`` changes with no event on the node."""
        return None

    def on_hit(self, node: Any, now: int) -> Iterable[Any]:
        """A request was admitted through ``node`` (and its ancestors); return other nodes
        whose priority this changed."""
        return ()

    def on_split(self, upper: Any, lower: Any) -> None:
        """``upper`` was cut from the top of ``lower``'s edge and copied its attributes."""

    def on_evict(self, node: Any, priority: tuple) -> None:
        """``node`` (which had ``priority``) leaves the tree."""

    def stats(self) -> EvictionStats | None:
        """Predictions and outcomes, for a policy that predicts (None: it does not)."""
        return None
