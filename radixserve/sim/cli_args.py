"""Parsing of the ``radixserve simulate`` options shared by its sub-commands: comma-separated
lists, ``key=value`` pairs, the trace named by ``--trace``, the timing model named by
``--timing``, the grid of cache settings and the engine of one of its cells, the output folder
and the run's metadata. A bad value is a parser error naming the option.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from radixserve.config import EngineConfig
from radixserve.sim.timing import TimingModel


def split_list(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in str(text).split(",") if x.strip()]


def is_off(text: str) -> bool:
    """Whether a list item turns its setting off (``none``, ``off`` or ``0``)."""
    return text.lower() in ("none", "off", "0")


def parse_threshold(text: str) -> float | None:
    return None if is_off(text) else float(text)


def build_trace(parser: argparse.ArgumentParser, args: argparse.Namespace):
    from radixserve.sim import workloads as w
    from radixserve.sim.trace import TraceError, load_mooncake

    extra = kv_pairs(args.trace_args)
    kind, _, rest = args.trace.partition(":")
    think = w.ThinkTime(args.think_time or 0.0, args.think_time_dist)
    try:
        if kind == "synthetic":
            if args.think_time is not None:
                extra["think_time"] = think
            spec = w.SyntheticSpec(num_sessions=args.sessions or 1000, **extra)
            trace = w.synthetic_trace(spec, args.seed)
        elif kind == "mooncake" or args.trace.endswith((".jsonl", ".jsonl.gz")):
            path = rest if kind == "mooncake" else args.trace
            trace = load_mooncake(path or None, seed=args.seed, **extra)
        elif kind in ("sharegpt", "bench"):
            tokenizer = load_tokenizer(args.model)
            if kind == "sharegpt":
                trace = w.sharegpt_trace(tokenizer, args.sessions or 200, args.max_turns,
                                         args.max_message_tokens, w.ThinkTime(
                                             30.0 if args.think_time is None else args.think_time,
                                             args.think_time_dist),
                                         args.dataset_path, args.seed, **extra)  # fmt: skip
            else:
                trace = w.bench_trace(tokenizer, rest, args.seed, think, **extra)
        else:
            parser.error(f"--trace: unknown {args.trace!r} (sharegpt, bench:NAME, synthetic, "
                         "mooncake, mooncake:PATH)")  # fmt: skip
    except (TraceError, ValueError, TypeError) as e:
        parser.error(f"--trace {args.trace}: {e}")
    if args.max_requests:
        trace = trace.head(args.max_requests)
    return trace


def kv_pairs(text: str) -> dict[str, Any]:
    pairs = {}
    for item in split_list(text):
        key, _, value = item.partition("=")
        pairs[key.strip()] = parse_value(value.strip())
    return pairs


def parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return None if text.lower() == "none" else text


def load_tokenizer(model: str | None):
    from radixserve.model.loader import resolve_model_path
    from radixserve.model.tokenizer import Tokenizer

    return Tokenizer.from_model_path(resolve_model_path(model), eos_token_ids=[])


def run_meta(trace, **extra) -> dict[str, Any]:
    return {"command": shlex.join(["radixserve", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "trace": {"name": trace.name, "sessions": len(trace.sessions),
                      "requests": trace.num_requests, "params": trace.params}, **extra}  # fmt: skip


def out_dir(args) -> Path:
    return Path(args.output_dir or f"sim_results/{time.strftime('%Y%m%d-%H%M%S')}")


def cache_grid(parser, args) -> list[tuple[int, str, float | None]]:
    try:
        kv = split_list(args.kv_tokens, int) if args.kv_tokens else []
        thresholds = split_list(args.cache_threshold, parse_threshold)
    except ValueError as e:
        parser.error(f"--kv-tokens / --cache-threshold: {e}")
    return list(itertools.product(kv, split_list(args.eviction), thresholds))


def engine_options(args: argparse.Namespace, kv: int, policy: str, threshold: float | None,
                   **options: Any) -> EngineConfig:  # fmt: skip
    """The engine config of one cell of ``cache_grid`` with the step options
    (``--page-size``, ``--chunked-prefill-size``, ``--max-running-requests``) and ``options``;
    a bad value is a ValueError naming the option."""
    return EngineConfig.from_options(
        max_total_tokens=kv, page_size=args.page_size, eviction_policy=policy,
        cache_threshold=threshold, chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests, load_progress=False, **options,
    )  # fmt: skip


def timing_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TimingModel:
    """The timing model ``--timing`` names (a profile or a JSON file)."""
    try:
        return TimingModel.load(args.timing)
    except ValueError as e:
        parser.error(f"--timing: {e}")


def check_plots(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop before a run whose plots could not be drawn."""
    from radixserve.utils import PLOT_EXTRA, plots_available

    if not args.no_plots and not plots_available():
        parser.error(f"{PLOT_EXTRA}, or pass --no-plots")
