"""``radixserve simulate fit``: measure this engine, fit a timing model, save it as JSON.

The engine part (``fit.fit_engine``) runs in this process. With ``--server`` the model is then
calibrated to the engine as it serves (``measure_served``): a real ``radixserve serve`` with
the same options and a step trace is started on a free port and sent short requests, one at a
time and ``--concurrency`` at a time; ``served.calibrate_served`` scales the step times to what
the served engine took and measures the time requests spend outside the engine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from radixserve.sim.timing import TimingModel


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
    p.add_argument(
        "--server", action="store_true",
        help="also measure the engine as it serves: start `radixserve serve` with a step trace, "
        "send short requests one at a time and --concurrency at a time, and calibrate the step "
        "times and the time requests spend outside the engine (sim/served.py)",
    )  # fmt: skip
    p.add_argument(
        "--concurrency", type=int, default=4,
        help="requests in flight in the second calibration run (>= 2); default %(default)s",
    )  # fmt: skip
    p.add_argument("--output", default="timing.json", help="where the model goes (JSON)")
    p.set_defaults(func=cmd_fit, parser=p)


def measure_served(
    timing: TimingModel, model: str | None, dtype: str, device: str, concurrency: int
) -> TimingModel:
    """Start ``radixserve serve`` with these options and a step trace on a free port,
    calibrate ``timing`` on it (``served.calibrate_served``) and return the served model."""
    from radixserve.bench import baselines
    from radixserve.sim.served import calibrate_served

    with tempfile.TemporaryDirectory() as logs:
        trace = Path(logs) / "steps.jsonl"
        settings = baselines.ServerSettings(
            model=model,
            slots=concurrency,
            log_dir=Path(logs),
            radix_args=("--dtype", dtype, "--device", device, "--step-trace", str(trace)),
        )
        with baselines.ManagedServer("fit", baselines.command("radix", settings), settings) as srv:
            return calibrate_served(srv.base_url, trace, timing, concurrency).apply(timing)


def cmd_fit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from radixserve.config import EngineConfig
    from radixserve.engine.engine import Engine
    from radixserve.sim.fit import fit_engine

    if args.concurrency < 2:
        parser.error(f"--concurrency must be at least 2, got {args.concurrency}")
    try:
        config = EngineConfig.from_options(
            model=args.model, dtype=args.dtype, device=args.device,
            max_total_tokens=args.max_total_tokens, load_progress=False,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    engine = Engine(config)
    timing = fit_engine(engine, args.max_len, args.repeats, plan=args.plan)
    del engine
    if args.server:
        timing = measure_served(timing, args.model, args.dtype, args.device, args.concurrency)
    timing.save(args.output)
    print(json.dumps({"ok": True, "output": args.output, **timing.__dict__}, default=str))
    return 0
