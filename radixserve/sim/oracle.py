"""Offline knowledge of a replay's future: tree-constrained Belady.

``FutureUses`` knows, for a fixed order of requests, which requests would use each part of
the tree. It builds an offline radix tree (the project's ``RadixCache``, unbounded) of every
sequence in the order, matching every prompt first so that every boundary any online tree
can have is a node boundary there too: online boundaries are sequence ends, prompt ends (a
prompt is published before its output), matched-prompt ends and divergence points between
sequences, all of which the offline tree has. Then each
request's matched path is recorded against the offline nodes it enters.

``BeladyPolicy`` evicts, among the evictable leaves (locks respected: locked nodes are never
leaves of the heap), the one whose next use is furthest in the future, never-used-again
first. An online leaf covering tokens ``[start, end)`` of its prefix is used by a request
exactly when that request's match enters the offline node starting at ``start`` on the same
path. The next use changes only when the clock (the admission count) passes it, which the
policy tells the heap (``changes_at``), so the heap stays exact.

Time is admission numbers: request ``j`` of the order (0-based) is admission ``j + 1``; the
replay admits each request before it allocates (and so evicts) for it.

Two weaker oracles measure how much of Belady's advantage an online policy could hope to
reach by predicting reuse alone, with LRU for everything the prediction leaves open (the
least recently used first among equals):

- ``oracle-returns`` knows whether each leaf will be used again, not when: a perfect
  classifier of returning leaves (what admission control and reuse models estimate);
- ``oracle-uses`` knows how many more requests will use each leaf (fewest first): a perfect
  frequency predictor (what LFU-like and GDSF-like policies estimate).

Neither knows the order of future uses, which is what Belady adds.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from radixserve.cache import PagedAllocator, RadixCache
from radixserve.cache.eviction import EvictionPolicy


class FutureUses:
    def __init__(self, requests: list[tuple[np.ndarray, np.ndarray, Any]], page_size: int = 1):
        """``requests``: (prompt, computed sequence, namespace) in admission order."""
        self.page_size = page_size
        total = sum(len(seq) for _, seq, _ in requests) + page_size
        alloc = PagedAllocator(total, page_size)
        tree = RadixCache(alloc)
        for prompt, seq, ns in requests:
            tree.match_prefix(prompt[:-1], ns, record_stats=False)  # boundary at the match end
            aligned = len(seq) - len(seq) % page_size
            m = tree.match_prefix(seq[:aligned], ns, record_stats=False)
            new = alloc.alloc(aligned - m.device_len)
            slots = torch.cat([m.device_indices, new])
            already = tree.insert(seq[:aligned], slots, ns)
            alloc.free(slots[m.device_len : already])
            tree.match_prefix(prompt, ns, record_stats=False)  # where the prompt is published
        self.tree = tree
        self.uses: dict[Any, list[int]] = defaultdict(list)
        for j, (prompt, _, ns) in enumerate(requests):
            for node_id in tree.peek_prefix(prompt[:-1], ns).path[1:]:
                self.uses[node_id].append(j + 1)

    def uses_from(self, prefix: np.ndarray, namespace: Any) -> list[int]:
        """Admission numbers of the requests whose match enters the offline node holding the
        last token of ``prefix`` (a prefix of some sequence of the order)."""
        peek = self.tree.peek_prefix(prefix, namespace)
        if peek.length != len(prefix) or len(peek.path) < 2:
            raise AssertionError("an online prefix is missing from the offline tree")
        return self.uses.get(peek.path[-1], [])


class BeladyPolicy(EvictionPolicy):
    name = "belady"

    def __init__(self, future: FutureUses):
        self.future = future

    def _uses(self, node: Any) -> list[int]:
        start = node.depth - len(node.key)
        state = node.policy_state
        if state is not None and state[0] == start:
            return state[1]
        keys, n = [], node.parent
        while n is not None and n.parent is not None:
            keys.append(n.key)
            n = n.parent
        head = node.key[: self.future.page_size]
        prefix = np.concatenate([*keys[::-1], head]) if keys else head
        uses = self.future.uses_from(prefix, node.namespace)  # the node holding our first page
        node.policy_state = (start, uses)
        return uses

    def next_use(self, node: Any, now: int) -> float:
        uses = self._uses(node)
        i = bisect.bisect_right(uses, now)
        return uses[i] if i < len(uses) else math.inf

    def priority(self, node: Any, now: int) -> tuple:
        return (-self.next_use(node, now), node.last_access)

    def changes_at(self, node: Any, now: int) -> int | None:
        nxt = self.next_use(node, now)
        return None if nxt == math.inf else int(nxt)

    def uses_left(self, node: Any, now: int) -> int:
        uses = self._uses(node)
        return len(uses) - bisect.bisect_right(uses, now)


class ReturnsOracle(BeladyPolicy):
    """Leaves never used again first, then LRU: knows whether, not when."""

    name = "oracle-returns"

    def priority(self, node: Any, now: int) -> tuple:
        return (int(self.uses_left(node, now) > 0), node.last_access)


class UsesOracle(BeladyPolicy):
    """Leaves with the fewest uses to come first, then LRU: knows how often, not when."""

    name = "oracle-uses"

    def priority(self, node: Any, now: int) -> tuple:
        return (self.uses_left(node, now), node.last_access)


ORACLES = {p.name: p for p in (BeladyPolicy, ReturnsOracle, UsesOracle)}
