"""Where a simulated fleet's load imbalance comes from, and the floor no router can beat.

Runs ``benchmarks/fleet/sim_fleet.py``'s workload (the same trace for the same N and seed) under
one routing policy and breaks the imbalance down:

- max / mean over instances of busy time (what ``sim_fleet.py`` reports), requests served,
  prompt tokens computed, decode tokens generated;
- the busiest instances: their busy time, requests and decode tokens against the mean, and
  the share of their requests behind the most popular system prompt (rank 1), the number of
  instances that served each of the three hottest prompts;
- the count-noise floor, from the trace alone (no simulation): decode tokens per instance
  (busy time is mostly answers on the CPU profile) when requests are dealt out perfectly
  evenly (round-robin order), when whole conversations are placed evenly (every turn at
  home, the number of conversations equal), and when conversations are placed at random
  (consistent hashing). Each is the median over 20 deals.

    python -m benchmarks.fleet.sim_imbalance --instances 100 --routing cache-aware

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

from benchmarks.fleet.sim_fleet import parse_value
from radixserve.config import EngineConfig
from radixserve.sim.loop import SimConfig, Simulation
from radixserve.sim.routing import RoutingConfig
from radixserve.sim.timing import TimingModel
from radixserve.sim.workloads import SyntheticSpec, ThinkTime, synthetic_trace


def max_over_mean(values) -> float:
    values = np.asarray(values, dtype=float)
    return float(values.max() / values.mean())


def floors(trace, n: int, seed: int) -> dict[str, float]:
    """Decode-token imbalance of cache-blind even deals of this trace over ``n`` instances."""
    conv = np.array([sum(len(t.output) for t in s.turns) for s in trace.sessions], float)
    per_request = np.array([len(t.output) for s in trace.sessions for t in s.turns], float)
    rng = np.random.default_rng(seed)
    even_req, even_conv, random_conv = [], [], []
    for _ in range(20):
        deal = rng.permutation(len(per_request)) % n  # an even deal of requests
        even_req.append(max_over_mean(np.bincount(deal, per_request, n)))
        deal = rng.permutation(len(conv)) % n  # an even deal of conversations
        even_conv.append(max_over_mean(np.bincount(deal, conv, n)))
        deal = rng.integers(0, n, len(conv))  # conversations hashed at random
        random_conv.append(max_over_mean(np.bincount(deal, conv, n)))
    return {
        "requests_even": float(np.median(even_req)),
        "conversations_even": float(np.median(even_conv)),
        "conversations_random": float(np.median(random_conv)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=100)
    p.add_argument("--routing", default="cache-aware")
    p.add_argument("--router-args", default="", help="k=v,... PolicyConfig fields")
    p.add_argument("--requests-per-instance", type=int, default=100)
    p.add_argument("--kv-tokens", type=int, default=20_000)
    p.add_argument("--top", type=int, default=5, help="busiest instances to describe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--floors-only", action="store_true", help="the trace's floors, no run")
    args = p.parse_args()
    n = args.instances
    spec = SyntheticSpec(
        num_sessions=max(1, n * args.requests_per_instance // 3),
        num_system_prompts=max(4, int(n * 0.1)),
        session_rate=0.02 * n,
        think_time=ThinkTime(20.0),
    )  # sim_fleet.py's defaults
    trace = synthetic_trace(spec, args.seed).head(n * args.requests_per_instance)
    out: dict = {"instances": n, "requests": trace.num_requests, "floor": floors(trace, n, 1)}
    if args.floors_only:
        print(json.dumps(out))
        return
    router_args = {}
    for item in filter(None, args.router_args.split(",")):
        key, _, value = item.partition("=")
        router_args[key] = parse_value(value)
    engine = EngineConfig.from_options(max_total_tokens=args.kv_tokens, chunked_prefill_size=256,
                          load_progress=False)  # fmt: skip
    routing = RoutingConfig(args.routing, seed=args.seed, policy_args=router_args)
    timing = TimingModel.load("cpu-smollm2-135m")
    result = Simulation(trace, SimConfig(engine, n, routing), timing).run()
    rec = result.records
    # each request's system prompt, ranked by popularity (its first system_prompt_len tokens)
    by_session = [s.turns[0].prompt[: spec.system_prompt_len].tobytes() for s in trace.sessions]
    rank = {key: r for r, (key, _) in enumerate(Counter(by_session).most_common())}
    inst = np.asarray(rec.instance)
    busy = np.array([i.busy_time for i in result.instances])
    served = np.array([i.served for i in result.instances], float)
    decode = np.array([i.decode_tokens for i in result.instances], float)
    prefill = np.array([i.prefill_tokens for i in result.instances], float)
    hit = float(rec.cached.sum() / rec.prompt_len.sum())
    out.update(
        routing=args.routing,
        router_args=args.router_args,
        hit_rate=hit,
        imbalance={
            "busy": max_over_mean(busy),
            "requests": max_over_mean(served),
            "prefill_tokens": max_over_mean(prefill),
            "decode_tokens": max_over_mean(decode),
        },
        busy_fraction_mean=float(busy.mean() / result.end_time),
        busy_fraction_max=float(busy.max() / result.end_time),
    )
    rows_rank = np.array([rank[by_session[s]] for s in rec.session])
    busiest = np.argsort(-busy)[: args.top]
    out["busiest"] = [
        {
            "instance": int(i),
            "busy_vs_mean": float(busy[i] / busy.mean()),
            "requests_vs_mean": float(served[i] / served.mean()),
            "decode_vs_mean": float(decode[i] / decode.mean()),
            "share_on_prompt_rank1": float(np.mean(rows_rank[inst == i] == 0)),
        }
        for i in busiest
    ]
    out["fleet_share_on_prompt_rank1"] = float(np.mean(rows_rank == 0))
    out["instances_serving_prompt_rank"] = [
        int(len(set(inst[rows_rank == r].tolist()))) for r in range(3)
    ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
