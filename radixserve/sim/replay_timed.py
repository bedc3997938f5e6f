"""Time to first token of a replayed trace: each pool and online policy of ``simulate replay``
also run through the event loop at the trace's own arrival times.

Requests overlap as they arrive; each instance is the engine's own core (``SimInstance``), so
prompts enter the tree as their prefill chunks finish and outputs when their requests end,
exactly as the server inserts them, and the eviction policy sees the server's sequence of
events. Steps take the timing model's time; ``--timing-speedup S`` divides every step and
overhead by S (a faster machine), which sets how loaded the instance is by the trace: the
shipped CPU profile computes a token of prefill in milliseconds, far too slow for a trace of
long prompts arriving every quarter second. Belady and the unbounded pool need the replay's
fixed order, so they have no timed row.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from radixserve.sim.cli_args import engine_options, timing_model
from radixserve.sim.loop import SimConfig, Simulation
from radixserve.sim.metrics import summarize
from radixserve.sim.routing import RoutingConfig
from radixserve.sim.timing import TimingModel
from radixserve.sim.trace import Trace

TIMED = ("ttft_p50_s", "ttft_p99_s", "hit_rate", "requests_failed", "wall_s")


def load_timing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TimingModel:
    if not args.timing_speedup > 0:
        parser.error(f"--timing-speedup must be > 0, got {args.timing_speedup}")
    return timing_model(parser, args).scaled(1 / args.timing_speedup)


def timed_row(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    trace: Trace,
    timing: TimingModel,
    pool: int,
    policy: str,
    threshold: float | None,
) -> dict[str, Any]:
    """The timed figures of one pool and policy, named ``timed_*`` (``timed_hit_rate``: the
    hit rate of the same requests served overlapping, which may differ from the replay's)."""
    try:
        engine = engine_options(args, pool, policy, threshold)
        config = SimConfig(engine, 1, RoutingConfig(seed=args.seed), args.max_concurrency,
                           args.session_rate, args.seed)  # fmt: skip
        sim = Simulation(trace, config, timing)
    except ValueError as e:
        parser.error(str(e))
    summary = summarize(sim.run())
    print(f"replay: timed {pool} tokens, {policy}: TTFT p50 {summary['ttft_p50_s']}, "
          f"hit rate {summary['hit_rate']} ({summary['wall_s']:.0f} s)",
          file=sys.stderr)  # fmt: skip
    return {k if k.startswith("ttft") else f"timed_{k}": summary[k] for k in TIMED}
