"""Eviction policies and their knobs against Belady at one pool size (cache-only replays).

The trace is the one of docs/simulator.md: 300 ShareGPT chats (up to 8 turns, messages cut
at 1024 tokens, the default model's chat template), Poisson session starts of 1 per second,
think time exponential of mean 30 s. The pool is ``--kv-tokens`` (118,784 = 25% of that
trace's distinct working set). Besides each policy at its default, it varies the knobs an
operator could turn: SLRU's protected share, the cost-aware policy's context scale (how fast
a token's recompute cost grows with depth), and ``--cache-threshold`` R on LRU and
cost-aware. Prints one line per replay and writes every hit rate to ``--output``.

    python -m benchmarks.fleet.sim_policy_knobs --output sim_results/knobs.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from radixserve.cache import eviction
from radixserve.sim.cli_args import load_tokenizer
from radixserve.sim.replay import replay, replay_order
from radixserve.sim.workloads import ThinkTime, sharegpt_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=300)
    p.add_argument("--kv-tokens", type=int, default=118_784)
    p.add_argument("--output", default="sim_results/policy_knobs.json")
    args = p.parse_args()
    trace = sharegpt_trace(load_tokenizer(None), args.sessions, 8, 1024, ThinkTime(30.0))
    order = replay_order(trace, None, 1.0, 0)
    rows: dict[str, float] = {}

    def run(label: str, policy: str, threshold: float | None = None) -> None:
        rows[label] = replay(order, args.kv_tokens, policy, cache_threshold=threshold).hit_rate
        print(f"{label}: {100 * rows[label]:.2f}% ({rows[label] / rows['belady']:.1%} of Belady)",
              flush=True)  # fmt: skip

    run("belady", "belady")
    for policy in eviction.EVICTION_POLICIES:
        run(policy, policy)
    default_share, default_scale = eviction.SLRU_PROTECTED_SHARE, eviction.COST_CONTEXT_SCALE
    try:  # the knobs are module constants (no flag): set them for one replay each
        for share in (0.2, 0.5, 0.95):
            eviction.SLRU_PROTECTED_SHARE = share
            run(f"slru share={share}", "slru")
        eviction.SLRU_PROTECTED_SHARE = default_share
        for scale in (512.0, 16384.0, 1e12):
            eviction.CostAwarePolicy.__init__.__defaults__ = (scale,)
            run(f"cost-aware context_scale={scale:g}", "cost-aware")
    finally:
        eviction.SLRU_PROTECTED_SHARE = default_share
        eviction.CostAwarePolicy.__init__.__defaults__ = (default_scale,)
    for r in (0.01, 0.02, 0.05, 0.1, 0.2, 0.3):
        run(f"lru threshold={r}", "lru", r)
        run(f"cost-aware threshold={r}", "cost-aware", r)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kv_tokens": args.kv_tokens, "requests": trace.num_requests,
                               "hit_rate": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
