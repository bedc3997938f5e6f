"""The reuse model of the ``reuse`` eviction policy (``eviction_reuse.py``): how likely a leaf
of some class is to be used again within a horizon, learned online from earlier leaves.

Episodes. A leaf's episode opens when the policy ranks it (cached, touched, or a leaf again
once its children left) and is counted under the leaf's class, a tuple of small integers
(``eviction_reuse.leaf_class``). It ends returned when a request's match enters the leaf, or,
if the leaf was evicted, when the same prefix is cached again below the same parent (its
ghost, below). It ends not returned when the horizon passes first; an episode whose leaf gets
a child or is ranked again is withdrawn (neither).

Estimate. Counts of episodes and returns per class prefix (the first k fields of the class,
k = 0..len): ``p(class) = (returns + K p(shorter prefix)) / (episodes + K)``, from 1/2 below
the empty prefix (every episode). A rare class borrows from the classes it refines, so a new
kind of leaf starts from what its coarser kind does. Episodes still open count as not (yet)
returned: recent classes read a little low, which the horizon bounds.

Horizon. Eviction happens at the idle age of the leaves the pool drops (``eviction_age``, an
exponential moving average over evictions); a leaf is useful if it returns within a few such
lifetimes, so the horizon is ``HORIZON_LIFETIMES`` of them (at least ``MIN_HORIZON``).
Time is the tree's touch clock (``last_access`` units).

Ghosts. An evicted leaf's open episode stays at its parent, keyed by the leaf's first tokens.
When its parent is evicted too, the ghosts it holds move into the parent's own ghost (with
their offsets), so a prefix evicted in several pieces is recognised when a request caches it
again in one. Every episode sits in a queue by opening time and leaves it at the horizon, so
ghosts cost memory for one horizon at most.
"""

from __future__ import annotations

from collections import deque
from typing import Any

BACKOFF = 4.0  # episodes a class needs before its own rate outweighs its coarser class's
HORIZON_LIFETIMES = 16
MIN_HORIZON = 512  # touches; the horizon before the pool has evicted anything
AGE_RATE = 0.01  # weight of one eviction in the eviction age's moving average
GHOST_HEAD = 8  # tokens that identify an evicted leaf below its parent


class Episode:
    """One leaf between its ranking and its next use; after eviction also its ghost."""

    __slots__ = ("start", "cls", "p", "open", "evicted", "tokens", "hits", "head", "holder",
                 "offset", "subs")  # fmt: skip

    def __init__(self, start: int, cls: tuple[int, ...], p: float):
        self.start, self.cls, self.p = start, cls, p
        self.open = True
        self.evicted = False
        self.tokens = 0
        self.hits = 0  # the leaf's uses so far, carried to a node that caches it again
        self.head = b""  # its first tokens, as a ghost
        self.holder: Any = None  # the node state whose ``ghosts`` holds it
        self.offset = 0  # tokens from the start of the ghost that contains it
        self.subs: list[Episode] = []  # ghosts of its evicted descendants


class ReuseModel:
    def __init__(self, prior: ReuseModel | None = None) -> None:
        """``prior``: start from its counts and eviction age (not its open episodes)."""
        # class prefix -> [episodes, returns]
        self.counts: dict[tuple[int, ...], list[int]] = (
            {} if prior is None else {k: list(v) for k, v in prior.counts.items()}
        )
        self.eviction_age: float | None = None if prior is None else prior.eviction_age
        self.queue: deque[Episode] = deque()

    @property
    def horizon(self) -> int:
        age = self.eviction_age or 0.0
        return max(MIN_HORIZON, int(HORIZON_LIFETIMES * age))

    def p(self, cls: tuple[int, ...]) -> float:
        p = 0.5
        for k in range(len(cls) + 1):
            n, r = self.counts.get(cls[:k], (0, 0))
            p = (r + BACKOFF * p) / (n + BACKOFF)
        return p

    def _count(self, cls: tuple[int, ...], episodes: int, returns: int) -> None:
        for k in range(len(cls) + 1):
            c = self.counts.setdefault(cls[:k], [0, 0])
            c[0] += episodes
            c[1] += returns

    def open(self, now: int, cls: tuple[int, ...]) -> Episode:
        self.expire(now)
        e = Episode(now, cls, self.p(cls))
        self._count(cls, 1, 0)
        self.queue.append(e)
        return e

    def withdraw(self, e: Episode | None) -> None:
        if e is not None and e.open:
            e.open = False
            self._count(e.cls, -1, 0)

    def close(self, e: Episode | None, now: int) -> bool:
        """A use of ``e``'s leaf at ``now``; True if it counts as returned."""
        if e is None or not e.open:
            return False
        e.open = False
        if now - e.start > self.horizon:
            return False
        self._count(e.cls, 0, 1)
        return True

    def expire(self, now: int) -> None:
        """Episodes past the horizon end not returned; their ghosts are forgotten."""
        queue, horizon = self.queue, self.horizon
        while queue and queue[0].start + horizon < now:
            e = queue.popleft()
            e.open = False
            holder = e.holder
            if holder is not None and holder.ghosts is not None:
                if holder.ghosts.get(e.head) is e:
                    del holder.ghosts[e.head]
            e.holder = None

    def evicted(self, age: int) -> None:
        """A leaf idle for ``age`` touches was evicted."""
        if self.eviction_age is None:
            self.eviction_age = float(age)
        else:
            self.eviction_age += AGE_RATE * (age - self.eviction_age)

    def ghost_placeholder(self, now: int) -> Episode:
        """A ghost for a node evicted with no open episode, to carry its descendants'."""
        e = Episode(now, (), 0.0)
        e.open = False
        self.queue.append(e)
        return e
