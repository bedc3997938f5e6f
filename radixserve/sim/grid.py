"""The grid behind ``radixserve simulate``: validate every configuration, then run each.

Every combination of the list options is validated before anything runs (a bad value is a
CLI error naming its flag). One instance needs no router, so it runs once and is reported
under every routing policy. ``--optimum`` adds, for each instance count N > 1, one instance
holding the KV pool and running requests of N, N times as fast (``SimConfig.pooled``): the
pooled optimum that routing is measured against.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

from radixserve.sim.cli_args import (
    build_trace,
    cache_grid,
    check_plots,
    engine_options,
    is_off,
    kv_pairs,
    out_dir,
    run_meta,
    split_list,
    timing_model,
)
from radixserve.sim.instance import host_tier_slots
from radixserve.sim.loop import SimConfig, Simulation
from radixserve.sim.metrics import summarize
from radixserve.sim.report import write_report
from radixserve.sim.routing import RoutingConfig


def simulate_grid(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_plots(parser, args)
    try:
        instances = split_list(args.instances, int)
    except ValueError as e:
        parser.error(f"--instances: {e}")
    hosts = [None if is_off(h) else h for h in split_list(args.host_kv_memory)]
    if args.write_policy and not any(hosts):
        parser.error("--write-policy needs a host tier: give --host-kv-memory")
    timing = timing_model(parser, args)
    configs = []  # every configuration is validated before anything runs
    for (kv, policy, threshold), host, n, routing in itertools.product(
        cache_grid(parser, args), hosts or [None], instances, split_list(args.routing)
    ):
        try:
            engine = engine_options(
                args, kv, policy, threshold, schedule_policy=args.schedule_policy,
                host_kv_memory=host, write_policy=args.write_policy if host else None,
            )  # fmt: skip
            host_tier_slots(engine, timing)
            route = RoutingConfig(routing, args.event_delay, args.event_loss, args.seed,
                                  kv_pairs(args.router_args))  # fmt: skip
            configs.append(SimConfig(engine, n, route, args.max_concurrency, args.session_rate,
                                     args.seed))  # fmt: skip
        except ValueError as e:
            parser.error(flag_names(str(e)))
    trace = build_trace(parser, args)
    if args.optimum:
        configs += [pooled(c) for c in configs if c.instances > 1]
        configs = list({_key(c): c for c in configs}.values())  # one pooled run per N
    rows, done = [], {}
    for config in configs:
        # one instance needs no router: run it once, report it under every routing policy
        key = _key(dataclasses.replace(config, routing=RoutingConfig(seed=config.seed))
                   if config.instances == 1 else config)  # fmt: skip
        if key not in done:
            try:
                sim = Simulation(trace, config, timing)
            except ValueError as e:
                parser.error(str(e).replace("max_concurrency", "--max-concurrency").replace(
                    "session_rate", "--session-rate"))  # fmt: skip
            done[key] = summarize(sim.run())
        row = {**done[key]}
        if config.pooled == 1:
            row["routing"] = config.routing.policy
        print(f"simulate: {row['instances']} x {row['kv_tokens_per_instance']} tokens, "
              f"{row['eviction_policy']}, {row['routing']}: hit rate {row['hit_rate']:.3f}, "
              f"TTFT p50 {row['ttft_p50_s']:.3f} s ({row['wall_s']:.1f} s)",
              file=sys.stderr)  # fmt: skip
        rows.append(row)
    meta = run_meta(trace, timing=timing.__dict__)
    out = write_report(out_dir(args), "radixserve simulate", rows, meta, not args.no_plots)
    print(json.dumps({"ok": True, **out, "rows": len(rows)}))
    return 0


FLAGS = {"max_total_tokens": "--kv-tokens", "eviction_policy": "--eviction",
         "cache_threshold": "--cache-threshold", "page_size": "--page-size",
         "chunked_prefill_size": "--chunked-prefill-size", "event_delay": "--event-delay",
         "max_running_requests": "--max-running-requests", "event_loss": "--event-loss",
         "instances": "--instances", "unknown router option": "unknown --router-args option",
         "routing policy": "--routing policy", "host_kv_memory": "--host-kv-memory",
         "write_policy": "--write-policy"}  # fmt: skip


def flag_names(message: str) -> str:
    """An error about a config field, naming the flag the user typed instead."""
    for field, flag in FLAGS.items():
        message = message.replace(field, flag)
    return message


def pooled(config: SimConfig) -> SimConfig:
    """One instance holding what ``config``'s N instances hold, N times as fast."""
    n, e = config.instances, config.engine
    host = e.tiers.host_kv_memory
    engine = e.replace(max_total_tokens=n * e.cache.max_total_tokens,
                       max_running_requests=n * e.scheduler.max_running_requests,
                       host_kv_memory=n * host if host else None)  # fmt: skip
    return dataclasses.replace(config, engine=engine, instances=1, pooled=n,
                               routing=RoutingConfig(seed=config.seed))  # fmt: skip


def _key(config: SimConfig) -> str:
    return repr((config.instances, config.pooled, config.engine, config.routing))
