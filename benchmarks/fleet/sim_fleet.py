"""Routing at scale with the simulator: hit rate and load imbalance from 1 to 1,000 instances.

Method: for each fleet size N the synthetic workload grows with the fleet (N x the sessions,
N x the session rate), so each instance sees the same load at every N. Every routing policy
of the router (``radixserve/router/policy.py``, driven in simulated time by
``radixserve/sim/routing.py``) places the same trace on N simulated instances, each a real
radix tree of ``--kv-tokens`` behind the engine's scheduler. The reference is the pooled
optimum: one cache holding all N pools, fed every request in arrival order (a cache-only
replay, ``sim/replay.py``; at large N a simulated N-times-faster instance would take hours of
Python for the same answer). Load imbalance is max / mean over instances of busy time (what
each computed) and of requests served. Wall time per run is the simulator's speed.

    python -m benchmarks.fleet.sim_fleet --instances 1,10,100,1000 --output-dir sim_results/fleet

Prints one JSON line at the end; writes results.json, report.md and the plot into
``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from radixserve.config import EngineConfig
from radixserve.sim.loop import SimConfig, Simulation
from radixserve.sim.metrics import summarize
from radixserve.sim.replay import replay, replay_order
from radixserve.sim.report import write_report
from radixserve.sim.routing import ROUTING_POLICIES, RoutingConfig
from radixserve.sim.timing import TimingModel
from radixserve.sim.workloads import SyntheticSpec, ThinkTime, synthetic_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", default="1,10,100,1000")
    p.add_argument("--routing", default=",".join(ROUTING_POLICIES))
    p.add_argument("--large-routing", default="cache-aware,round-robin,consistent-hash",
                   help="policies run at N >= --large (the slowest runs)")  # fmt: skip
    p.add_argument("--large", type=int, default=1000)
    p.add_argument("--requests-per-instance", type=int, default=100)
    p.add_argument("--session-rate-per-instance", type=float, default=0.02)
    p.add_argument("--kv-tokens", type=int, default=20_000)
    p.add_argument("--system-prompts-per-instance", type=float, default=0.1)
    p.add_argument("--router-args", default="", help="k=v,... PolicyConfig fields")
    p.add_argument("--timing", default="cpu-smollm2-135m")
    p.add_argument("--output-dir", default="sim_results/fleet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--merge", action="store_true",
        help="keep the rows of --output-dir/results.json for other (instances, routing) pairs "
        "(one table and plot from runs made one fleet size at a time)",
    )  # fmt: skip
    args = p.parse_args()
    timing = TimingModel.load(args.timing)
    router_args = {}
    for item in filter(None, args.router_args.split(",")):
        key, _, value = item.partition("=")
        router_args[key] = parse_value(value)
    rows = []
    for n in [int(x) for x in args.instances.split(",")]:
        spec = SyntheticSpec(
            num_sessions=max(1, n * args.requests_per_instance // 3),
            num_system_prompts=max(4, int(n * args.system_prompts_per_instance)),
            session_rate=args.session_rate_per_instance * n,
            think_time=ThinkTime(20.0),
        )
        trace = synthetic_trace(spec, args.seed).head(n * args.requests_per_instance)
        t0 = time.perf_counter()
        ceiling = replay(replay_order(trace), n * args.kv_tokens, "lru")
        rows.append(dict(trace=trace.name, instances=n, routing="pooled optimum",
                         eviction_policy="lru", page_size=1, schedule_policy="lpm",
                         kv_tokens_per_instance=args.kv_tokens, hit_rate=ceiling.hit_rate,
                         requests=trace.num_requests,
                         wall_s=time.perf_counter() - t0))  # fmt: skip
        policies = args.large_routing if n >= args.large else args.routing
        for policy in policies.split(",") if n > 1 else ["round-robin"]:
            engine = EngineConfig.from_options(
                max_total_tokens=args.kv_tokens, chunked_prefill_size=256, load_progress=False
            )
            routing = RoutingConfig(policy, seed=args.seed, policy_args=router_args)
            result = Simulation(trace, SimConfig(engine, n, routing), timing).run()
            row = summarize(result)
            if router_args and policy.startswith("cache-aware"):  # a tuned variant: say so
                row["routing"] = f"{policy} ({args.router_args})"
            row["vs_pooled_optimum"] = row["hit_rate"] / ceiling.hit_rate
            rows.append(row)
            print(f"N={n} {policy}: hit {row['hit_rate']:.3f} ({row['vs_pooled_optimum']:.2f}"
                  f" of pooled), imbalance busy {row['load_imbalance_busy']:.2f} requests "
                  f"{row['load_imbalance_requests']:.2f}, {row['requests']} requests in "
                  f"{row['wall_s']:.0f} s", flush=True)  # fmt: skip
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    command = f"python -m benchmarks.fleet.sim_fleet {flags}"
    meta = {"command": command, "timing": timing.meta}
    if args.merge:
        rows, meta = merged(Path(args.output_dir), rows, command, meta)
    out = write_report(Path(args.output_dir), "Routing at scale (simulated)", rows, meta)
    print(json.dumps({"ok": True, **out}))


def parse_value(value: str) -> int | float | str | None:
    """A ``--router-args`` value: an int, a float, None for ``off``, else the string."""
    if value == "off":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def merged(out_dir: Path, rows: list[dict], command: str, meta: dict) -> tuple[list, dict]:
    """The earlier rows of ``out_dir`` that these runs did not redo, then these, ordered by
    fleet size; the meta lists every command that contributed."""
    path = out_dir / "results.json"
    if not path.is_file():
        return rows, {**meta, "commands": [command]}
    old = json.loads(path.read_text())
    key = lambda r: (r["instances"], r["routing"])  # noqa: E731
    redone = {key(r) for r in rows}
    kept = [r for r in old["rows"] if key(r) not in redone]
    commands = [c for c in old.get("commands", [old.get("command")]) if c] + [command]
    return sorted(kept + rows, key=lambda r: r["instances"]), {**meta, "commands": commands}


if __name__ == "__main__":
    main()
