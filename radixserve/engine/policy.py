"""Waiting-queue order: which queued request the scheduler tries to admit first.

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first, so requests that reuse the cache run while it still
  holds their prefix (falls back to fcfs for very long queues, where matching costs more).
- ``dfs-weight``: walk the radix tree depth-first, heavier branches (more waiting requests)
  first, serving requests branch by branch so a shared prefix is used by all its requests
  before eviction can take it; requests that match nothing come last.

Starvation guard: a request overtaken by ``max_overtakes`` younger admissions goes first,
whatever the policy. Policies look with ``peek_prefix``, which changes nothing in the cache
(no split, no recency update), and see the tree only as opaque node ids along a path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable

from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.request import Request

LPM_MAX_QUEUE = 256


def order_waiting(
    waiting: list[Request], policy: str, kv: RequestKV, max_overtakes: int
) -> list[Request]:
    starving = sorted(
        (r for r in waiting if r.times_overtaken >= max_overtakes), key=lambda r: r.arrival
    )
    rest = [r for r in waiting if r.times_overtaken < max_overtakes]
    if policy == "fcfs" or len(rest) > LPM_MAX_QUEUE:
        ordered = sorted(rest, key=lambda r: r.arrival)
    elif policy == "lpm":
        lengths = {id(r): kv.peek(r).length for r in rest}
        ordered = sorted(rest, key=lambda r: (-lengths[id(r)], r.arrival))
    elif policy == "dfs-weight":
        ordered = _dfs_weight_order(rest, kv)
    else:
        raise ValueError(f"unknown schedule policy {policy!r}")
    return starving + ordered


def _dfs_weight_order(reqs: list[Request], kv: RequestKV) -> list[Request]:
    """Order by a weighted post-order walk of the tree paths the requests match."""
    at_node: dict[Hashable, list[Request]] = defaultdict(list)
    weight: dict[Hashable, int] = defaultdict(int)
    oldest: dict[Hashable, int] = {}  # earliest arrival in the subtree: breaks weight ties
    children: dict[Hashable, set[Hashable]] = defaultdict(set)
    roots: set[Hashable] = set()
    unmatched: list[Request] = []  # namespaces with nothing cached yet
    for r in sorted(reqs, key=lambda r: r.arrival):
        path = kv.peek(r).path
        if not path:
            unmatched.append(r)
            continue
        at_node[path[-1]].append(r)
        roots.add(path[0])
        for i, node in enumerate(path):
            weight[node] += 1
            oldest.setdefault(node, r.arrival)
            if i:
                children[path[i - 1]].add(node)

    def visit_last_first(nodes):  # the stack pops the heaviest (then oldest) node first
        return sorted(nodes, key=lambda n: (weight[n], -oldest[n]))

    # Post-order: a node's subtree (deepest matches, heaviest branch first) before the requests
    # that matched only the node itself, so requests with no match at all come last and do not
    # evict the prefixes the others are about to use.
    ordered: list[Request] = []
    stack = [(node, False) for node in visit_last_first(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            ordered.extend(at_node.get(node, ()))
        else:
            stack.append((node, True))
            stack.extend((child, False) for child in visit_last_first(children.get(node, ())))
    return ordered + unmatched
