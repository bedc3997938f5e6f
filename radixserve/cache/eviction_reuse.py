"""``reuse``: LRU shifted by a learned chance that each leaf is used again.

Why: a leaf is worth keeping if a request will come back to it before the pool would drop it.
LRU ranks leaves by idle time alone; which leaves come back depends on what they are: a
prefix that conversations have already come back to, a prompt whose answer was a short tool
call rather than a long final answer, the tail of a prompt the next turn bypassed, a long
shared document rather than a one-off question. ``reuse_model.ReuseModel`` learns online, per
class of leaf, how often leaves came back within a horizon of a few pool lifetimes, counting
returns after eviction too (ghosts), so a class the pool evicts early is not judged by the
hits it never had the chance to get.

A leaf's class (``leaf_class``), from what the tree knows of it, coarsest first:

- its uses: the node's hit count plus those of the evicted node it replaces (a prefix that
  comes back after eviction keeps its history), capped at 5;
- whether it hangs from the root (the start of a conversation or document);
- the length class (log2) of the child cached last below it (0: never one): for a prompt,
  its answer;
- its depth class (log2 of tokens from the root): the prefix position;
- whether a request bypassed it: its parent was the end of a match that went elsewhere, or a
  match ended inside it (the rest of it);
- the class (log2) of the touches between its last two uses: how fast its conversation moves.

Rank: ``last_access + eviction_age x logit(p)``, clipped to +-8 lifetimes: a leaf likely to
return outlives LRU by a few pool lifetimes, an unlikely one goes first. The value is fixed
when the leaf is ranked (the class and estimate of that moment), so the lazy heap needs no
time-driven re-push. Cost: O(1) per ranking, hit and eviction (a few dictionary lookups), on
top of the heap's O(log n); the tree is never walked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from radixserve.cache.eviction_base import EvictionPolicy, EvictionStats
from radixserve.cache.reuse_model import GHOST_HEAD, Episode, ReuseModel

MAX_LOGIT = 8.0  # clip: no class is certain
_CAP = 24


def _log2_class(x: int) -> int:
    return min(max(x, 0).bit_length(), _CAP)


class LeafState:
    """The policy's state of one node (``TreeNode.policy_state``)."""

    __slots__ = ("ranked_at", "value", "episode", "stale", "latest", "child_len", "bypassed",
                 "history", "gap", "last_use", "ghosts")  # fmt: skip

    def __init__(self) -> None:
        self.ranked_at = -1  # the last_access it was ranked at (-1: never ranked)
        self.value = 0.0
        self.episode: Episode | None = None
        self.stale = False  # rank again at the next push
        self.latest: Any = None  # the child cached or cut last below it
        self.child_len = 0  # that child's length when it was cached
        self.bypassed = False
        self.history = 0  # uses of the evicted node this one caches again
        self.gap = 0  # touches between its last two uses
        self.last_use = 0
        self.ghosts: dict[bytes, Episode] | None = None  # evicted children, by first tokens


def leaf_class(node: Any, state: LeafState) -> tuple[int, ...]:
    parent = node.parent
    return (
        min(node.hit_count + state.history, 5),
        int(parent is not None and parent.parent is None),
        _log2_class(state.child_len),
        _log2_class(node.depth),
        int(state.bypassed),
        _log2_class(state.gap),
    )


class ReusePolicy(EvictionPolicy):
    name = "reuse"

    def __init__(self, prior: ReuseModel | None = None) -> None:
        """``prior``: a model whose counts and eviction age this one starts from (a model
        learned on other traffic); None: from nothing."""
        self.touch_clock: Callable[[], int] = int  # the tree's (``last_access`` units)
        self.model = ReuseModel(prior)
        self._stats = EvictionStats(self.name)

    def bind(self, total_tokens: Callable[[], int], touch_clock: Callable[[], int]) -> None:
        self.touch_clock = touch_clock

    def _state(self, node: Any) -> LeafState:
        s = node.policy_state
        if s is None:
            s = node.policy_state = LeafState()
        return s

    # ------------------------------------------------------------------ ranking
    def priority(self, node: Any, now: int) -> tuple:
        s = self._state(node)
        if s.ranked_at == node.last_access and not s.stale:
            return (s.value,)
        if s.ranked_at == -1:
            self._cached(node, s)
        s.stale = False
        self.model.withdraw(s.episode)  # ranked again before it was used: superseded
        cls = leaf_class(node, s)
        e = s.episode = self.model.open(self.touch_clock(), cls)
        p = min(max(e.p, 1e-6), 1 - 1e-6)
        z = max(-MAX_LOGIT, min(MAX_LOGIT, math.log(p / (1 - p))))
        s.ranked_at = node.last_access
        s.value = node.last_access + (self.model.eviction_age or 0.0) * z
        return (s.value,)

    def _cached(self, node: Any, s: LeafState) -> None:
        """A new node: its parent has a child now (no longer a leaf), and may hold the ghost
        of the evicted node this one caches again."""
        parent = node.parent
        if parent is None:
            return
        ps = self._state(parent)
        s.last_use = node.last_access
        self.model.withdraw(ps.episode)
        if parent.parent is not None:
            s.gap = ps.gap
            ps.latest, ps.child_len = node, len(node.key)
        if ps.ghosts:
            ghost = ps.ghosts.pop(node.key[:GHOST_HEAD].tobytes(), None)
            if ghost is not None:
                ghost.holder = None
                s.history = ghost.hits + 1
                self._came_back(ghost, node.key, 0, node.last_access)

    def _came_back(self, ghost: Episode, key: Any, at: int, now: int) -> None:
        """``key`` (from position ``at``) caches again what ``ghost``'s leaf held; so do the
        ghosts inside it whose first tokens it has at their offsets."""
        if ghost.open and self.model.close(ghost, now):
            self._stats.returned_leaves += 1
            self._stats.returned_tokens += ghost.tokens
        for sub in ghost.subs:
            k = at + sub.offset
            if k < len(key) and key[k : k + GHOST_HEAD].tobytes() == sub.head:
                self._came_back(sub, key, k, now)

    # ------------------------------------------------------------------ events
    def on_hit(self, node: Any, now: int) -> Iterable[Any]:
        s = self._state(node)
        if self.model.close(s.episode, node.last_access):
            self._stats.reused_leaves += 1
        s.gap, s.last_use = node.last_access - s.last_use, node.last_access
        latest = s.latest  # the request went past ``node`` elsewhere (or ended there)
        if latest is not None and latest.parent is node and not latest.children:
            ls = self._state(latest)
            if not ls.bypassed:
                ls.bypassed = ls.stale = True
                return (latest,)
        return ()

    def on_split(self, upper: Any, lower: Any) -> None:
        """A match ending inside ``lower`` cut ``upper`` from it: the use that follows is
        ``upper``'s (it takes the episode), and ``lower`` is the bypassed rest."""
        s = lower.policy_state
        if s is None:
            return
        us = upper.policy_state = LeafState()
        us.ranked_at, us.value, us.history = s.ranked_at, s.value, s.history
        us.gap, us.last_use = s.gap, s.last_use
        us.episode, s.episode = s.episode, None
        us.latest, us.child_len = lower, len(lower.key)

    def on_evict(self, node: Any, priority: tuple) -> None:
        parent = node.parent
        if parent is None or getattr(node, "value", None) is None:
            return  # a host-tier eviction: the device side already counted it
        now = self.touch_clock()
        self.model.evicted(now - node.last_access)
        s = self._state(node)
        ps = self._state(parent)
        if ps.latest is node:
            ps.latest = None
        if parent.parent is not None:
            ps.stale = True  # a leaf again soon: rank it then, as it is then
        e = s.episode
        if e is not None and e.open:
            self._stats.evicted_leaves += 1
            self._stats.predicted_returns += e.p
            e.evicted = True
        if getattr(node, "host_value", None) is not None:
            return  # stays in the tree on the host: a later use is a hit, not a ghost
        self._leave_ghost(node, s, ps, e, now)

    def _leave_ghost(self, node: Any, s: LeafState, ps: LeafState, e: Episode | None,
                     now: int) -> None:  # fmt: skip
        if e is None or not e.open:
            if not s.ghosts:
                return
            e = self.model.ghost_placeholder(now)
        e.head = node.key[:GHOST_HEAD].tobytes()
        e.tokens = len(node.key)
        e.hits = node.hit_count + s.history
        for sub in (s.ghosts or {}).values():
            sub.offset, sub.holder = len(node.key), None
            e.subs.append(sub)
        s.ghosts = None
        if ps.ghosts is None:
            ps.ghosts = {}
        e.holder = ps
        ps.ghosts[e.head] = e

    def stats(self) -> EvictionStats:
        st = self._stats
        st.horizon = self.model.horizon
        st.eviction_age = self.model.eviction_age or 0.0
        return EvictionStats(**st.__dict__)
