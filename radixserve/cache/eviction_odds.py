"""``return-odds``: LRU with a learned bonus for leaves whose prefixes tend to come back.

Why: in chat traffic a cached leaf is the end of a conversation's latest turn; it is worth
keeping only if the user returns. LRU ranks leaves by idle time alone, which is right when
every leaf is equally likely to return. They are not: conversations end, and how likely one
is to go on depends on how far it has gone (its depth in tokens). Belady knows which
conversations ended; this policy estimates it online.

Model: a leaf returns with probability ``p`` (by depth class, learned), after an idle time
that is exponential of mean ``theta`` (learned). Given it has been idle ``a``, the odds that
it still returns are ``p e^(-a/theta) / (1 - p)``; ranking leaves by those odds is ranking by
``last_access + theta x logit(p)``, a constant per leaf between its touches, so the lazy heap
needs no time-driven re-push. Size drops out: keeping a leaf costs its tokens and saves its
tokens.

Learning (no trace knowledge): per depth class (``log2`` of the node's depth in tokens), how
many leaves were cached and how many were later reused (a request's deepest match was the
node, for the first time): ``p = (reused + 1) / (cached + 2)``; ``theta`` is the running mean
idle time (in the touch clock's units) at those first reuses. Until anything is learned the
bonus is 0: plain LRU. A leaf's value is frozen in ``policy_state`` when it is first ranked
after a touch, so the heap's stored priority stays valid while estimates move on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from radixserve.cache.eviction_base import EvictionPolicy

_CLASSES = 24  # depth classes: log2 of the depth in tokens, capped


class ReturnOddsPolicy(EvictionPolicy):
    name = "return-odds"

    def __init__(self) -> None:
        self.cached = [0] * _CLASSES
        self.reused = [0] * _CLASSES
        self._gap_sum = 0.0
        self._gaps = 0

    @staticmethod
    def _class(node: Any) -> int:
        return min(max(node.depth, 1).bit_length() - 1, _CLASSES - 1)

    def bonus(self, depth_class: int) -> float:
        """``theta x logit(p)`` for a leaf of that class, in touch-clock units."""
        if not self._gaps:
            return 0.0
        cached = self.cached[depth_class]  # (a split half can be reused, never counted)
        p = (min(self.reused[depth_class], cached) + 1) / (cached + 2)
        return self._gap_sum / self._gaps * math.log(p / (1 - p))

    def priority(self, node: Any, now: int) -> tuple:
        # policy_state: (last_access it was ranked at, value, the last_access before that)
        state = node.policy_state
        if state is None:  # first seen: count it (a split's halves share the state)
            self.cached[self._class(node)] += 1
        elif state[0] == node.last_access:
            return (state[1],)
        value = node.last_access + self.bonus(self._class(node))
        before = state[0] if state is not None else node.last_access
        node.policy_state = (node.last_access, value, before)
        return (value,)

    def on_hit(self, node: Any, now: int) -> Iterable[Any]:
        state = node.policy_state
        if node.hit_count == 1 and state is not None:  # its first reuse since it was cached
            # the match touched it just now (and may have re-ranked it): idle since the touch
            # before that
            last = state[2] if state[0] == node.last_access else state[0]
            self.reused[self._class(node)] += 1
            self._gap_sum += max(node.last_access - last, 0)
            self._gaps += 1
        return ()

    def on_evict(self, node: Any, priority: tuple) -> None:
        # the parent's reuse is the same conversation coming back: no likelier than the leaf's.
        # Only for a leaf leaving the device tree (``value`` set): then its parent still has
        # it as a child, so is in no heap as a live leaf and may take a new value. A host-tier
        # eviction (``value`` None) can leave a parent that is a live device leaf, whose heap
        # entry a new value would invalidate.
        parent = node.parent
        if parent is None or parent.parent is None or getattr(node, "value", None) is None:
            return
        state = parent.policy_state
        if state is None or state[0] != parent.last_access:
            self.priority(parent, 0)  # rank it now, at its own class
            state = parent.policy_state
        if priority[0] < state[1]:
            parent.policy_state = (state[0], priority[0], state[2])
