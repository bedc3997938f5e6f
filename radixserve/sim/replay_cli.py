"""The grid of ``radixserve simulate replay``: designs x pool sizes x policies, plus the
memory each design needs to reach a share of the unbounded hit rate.

The working set a ``--kv-fraction`` is a share of: ``distinct`` (every token the trace
caches, the unbounded tree's final size) or ``live`` (the most tokens the sessions in
progress hold at once, ``replay.peak_live_tokens``).

Pool sizes come from ``--kv-tokens`` if given, else ``--kv-fraction`` (default: 1, 2, 5, 10,
25 and 40% of the working set).

Reference points in every row: ``unbounded_hit_rate`` (the token-level tree holding
everything: the ceiling for every design) and, where Belady ran for the same design and pool,
``belady_hit_rate`` and ``vs_belady`` (the row's hit rate over Belady's). With ``--ttft``
each online policy's tree row also gets ``ttft_p50_s`` / ``ttft_p99_s`` (and ``timed_*``
figures) from the event loop at the trace's own arrival times (``replay_timed.py``).

``--target-fraction F`` adds one row per design: the smallest pool (tokens of KV) whose hit
rate reaches ``F x`` the unbounded hit rate, found by bisection over the pool size (LRU for
the trees; whole slots of the longest sequence for ``slots``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from radixserve.cache.eviction import EVICTION_POLICIES
from radixserve.sim.cli_args import parse_threshold, split_list
from radixserve.sim.oracle import ORACLES, FutureUses
from radixserve.sim.replay import (
    OFFLINE_POLICIES,
    Order,
    computed,
    peak_live_tokens,
    replay,
    slot_replay,
)
from radixserve.sim.replay_timed import load_timing, timed_row

DESIGNS = {"tree": 1, "blocks": 16, "slots": 1}  # design: page size


def _future(order: Order, page_size: int) -> FutureUses:
    return FutureUses([(t.prompt, computed(t), s.namespace) for s, t in order], page_size)


def min_pool(hit_rate: Callable[[int], float], target: float, lo: int, hi: int) -> int | None:
    """The smallest pool in [lo, hi] with ``hit_rate(pool) >= target`` (None if even ``hi``
    falls short), to within 1%; assumes the hit rate grows with the pool."""
    if hit_rate(hi) < target:
        return None
    while hi > lo * 1.01 + 1:
        mid = (lo + hi) // 2
        if hit_rate(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def replay_rows(
    parser: argparse.ArgumentParser, args: argparse.Namespace, trace: Any, order: Order
) -> list[dict[str, Any]]:
    designs = split_list(args.design)
    for d in designs:
        if d not in DESIGNS:
            parser.error(f"--design: unknown {d!r}; choose from {', '.join(DESIGNS)}")
    policies = split_list(args.eviction)
    for p in policies:
        if p not in (*EVICTION_POLICIES, *OFFLINE_POLICIES):
            parser.error(f"--eviction: unknown {p!r}; choose from "
                         f"{', '.join((*EVICTION_POLICIES, *OFFLINE_POLICIES))}")  # fmt: skip
    thresholds = split_list(args.cache_threshold, parse_threshold)
    timing = load_timing(parser, args) if args.ttft else None
    ceiling = replay(order, 0, "unbounded")
    working_set, live = ceiling.tree_tokens, peak_live_tokens(order)
    pools = _pools(parser, args, working_set, live)
    longest = trace.max_sequence()
    base = {"trace": trace.name, "working_set_tokens": working_set,
            "live_working_set_tokens": live, "unbounded_hit_rate": ceiling.hit_rate}  # fmt: skip
    rows: list[dict[str, Any]] = []
    for design in designs:
        page = DESIGNS[design]
        oracles = [p for p in policies if p in ORACLES]
        future = _future(order, page) if oracles and design != "slots" else None
        for pool in pools:
            if design == "slots":
                slots = max(1, pool // longest)
                r = slot_replay(order, slots, longest)
                rows.append({**base, "design": design, "policy": f"{slots} slots",
                             "kv_tokens": r.kv_tokens, **_stats(r)})  # fmt: skip
                continue
            here = []
            for policy in policies:
                for threshold in thresholds if policy not in OFFLINE_POLICIES else [None]:
                    r = replay(order, pool, policy, page, threshold, future)
                    row = {**base, "design": design, "policy": r.policy, "kv_tokens": pool,
                           **_stats(r)}  # fmt: skip
                    if timing is not None and design == "tree" and policy not in OFFLINE_POLICIES:
                        row.update(timed_row(parser, args, trace, timing, pool, policy, threshold))
                    here.append(row)
            belady = next((r["hit_rate"] for r in here if r["policy"] == "belady"), None)
            for row in here:
                if belady:
                    row["belady_hit_rate"], row["vs_belady"] = belady, row["hit_rate"] / belady
            rows += here
    if getattr(args, "target_fraction", None):
        target = args.target_fraction * ceiling.hit_rate
        for design in designs:
            rows.append({**base, **_memory_row(design, order, target, working_set, longest),
                         "target_hit_rate": target})  # fmt: skip
    return rows


def _pools(parser, args, working_set: int, live: int) -> list[int]:
    """Pool sizes in tokens: ``--kv-tokens`` if given, else ``--kv-fraction`` of the working
    set."""
    try:
        if args.kv_tokens:
            return split_list(args.kv_tokens, int)
        whole = live if args.working_set == "live" else working_set
        return [max(1, int(float(f) * whole)) for f in split_list(args.kv_fraction)]
    except ValueError as e:
        parser.error(f"--kv-tokens / --kv-fraction: {e}")


def _memory_row(design: str, order: Order, target: float, working_set: int, longest: int):
    if design == "slots":
        slots = min_pool(lambda n: slot_replay(order, n, longest).hit_rate, target, 1,
                         max(2, len(order)))  # fmt: skip
        tokens = None if slots is None else slots * longest
        return {"design": design, "policy": "memory for target", "kv_tokens": tokens,
                "slots": slots}  # fmt: skip
    page = DESIGNS[design]
    tokens = min_pool(lambda n: replay(order, n, "lru", page).hit_rate, target, longest + page,
                      working_set + page)  # fmt: skip
    return {"design": design, "policy": "memory for target", "kv_tokens": tokens}


def _stats(r) -> dict[str, Any]:
    return {"hit_rate": r.hit_rate, "prefill_tokens_saved": r.cached_tokens,
            "evicted_tokens": r.evicted_tokens, "requests": r.requests,
            "requests_failed": r.failed}  # fmt: skip
