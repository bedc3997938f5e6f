"""``radixserve simulate fit``: measure this engine, fit a timing model, save it as JSON.

The engine part (``fit.fit_engine``) runs in this process. With ``--server`` the request
overhead is measured too (``measure_request_overhead``): a real ``radixserve serve`` with the
same options is started on a free port and sent one short request at a time by the bench's
load generator; each request's time to first token minus the fitted engine time of its
prefill step is time spent outside the engine's steps (HTTP, tokenizing, the hop to the
engine process and back, the engine loop noticing the request). The median is saved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from radixserve.sim.timing import TimingModel

OVERHEAD_REQUESTS = 12


def add_fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-total-tokens", type=int, default=80_000, help="KV pool while measuring")
    p.add_argument("--max-len", type=int, default=2048, help="longest context measured")
    p.add_argument(
        "--repeats", type=int, default=3,
        help="passes over the measurement plan; each step keeps its fastest time",
    )  # fmt: skip
    p.add_argument(
        "--plan", default="full", choices=("full", "quick"),
        help="full: prompts to --max-len, batches to 32; quick: fewer, shorter steps",
    )  # fmt: skip
    p.add_argument("--server", action="store_true", help="also measure the request overhead")
    p.add_argument("--output", default="timing.json", help="where the model goes (JSON)")
    p.set_defaults(func=cmd_fit, parser=p)


def request_overhead_of(base_url: str, timing: TimingModel, requests: int = OVERHEAD_REQUESTS):
    """The median of (TTFT - fitted prefill step time) over one-at-a-time short requests to
    the running server at ``base_url``."""
    from radixserve.bench.loadgen import LoadConfig, run_load
    from radixserve.bench.workloads import build_workload

    workload = build_workload("random", 0, num_prompts=requests, input_len=32, output_len=2)
    load = LoadConfig(base_url=base_url, max_concurrency=1, warmup_requests=2,
                      metrics_interval=0, progress=False)  # fmt: skip
    result = run_load(workload, load)
    gaps = [
        r.ttft - timing.step_time([(r.prompt_tokens, 0)])
        for r in result.records
        if r.success and r.ttft is not None and r.prompt_tokens
    ]
    if not gaps:
        raise RuntimeError("no request succeeded while measuring the request overhead")
    return max(0.0, statistics.median(gaps))


def measure_request_overhead(timing: TimingModel, model: str | None, dtype: str, device: str):
    """Start ``radixserve serve`` with these options on a free port and measure it."""
    from radixserve.bench import baselines

    with tempfile.TemporaryDirectory() as logs:
        settings = baselines.ServerSettings(
            model=model,
            slots=1,
            log_dir=Path(logs),
            radix_args=("--dtype", dtype, "--device", device),
        )
        with baselines.ManagedServer("fit", baselines.command("radix", settings), settings) as srv:
            return request_overhead_of(srv.base_url, timing)


def cmd_fit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from radixserve.config import EngineConfig
    from radixserve.engine.engine import Engine
    from radixserve.sim.fit import fit_engine

    try:
        config = EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device,
            max_total_tokens=args.max_total_tokens, load_progress=False,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    engine = Engine(config)
    timing = fit_engine(engine, args.max_len, args.repeats, plan=args.plan)
    del engine
    if args.server:
        timing.request_overhead = measure_request_overhead(
            timing, args.model, args.dtype, args.device
        )
        timing.meta["request_overhead_requests"] = OVERHEAD_REQUESTS
    timing.save(args.output)
    print(json.dumps({"ok": True, "output": args.output, **timing.__dict__}, default=str))
    return 0
