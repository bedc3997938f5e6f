"""Prefill/decode disaggregation against colocated serving, side by side in one run.

Deployments, on this machine (2 cores), each started fresh on free loopback ports:

- ``colocated``: one ``radixserve serve`` using both cores;
- ``dp2``: two colocated instances, one core each (``taskset``), behind ``radixserve router``
  (cache-aware);
- ``pd``: one prefill instance (core 0) and one decode instance (core 1) behind
  ``radixserve router --prefill ... --decode ...``;
- ``pd-resend``: the same, but the decode instance keeps no prefix cache
  (``--disable-prefix-caching``) and no split is made (``--local-prefill-tokens 0``,
  ``--remote-prefill-min-tokens 1``: the router's prediction of a cache would otherwise keep
  later turns local), so every request moves its whole prompt: the history-resend design
  that decode-side reuse is measured against.

Each deployment runs each workload through ``radixserve bench --base-url`` (the same load
generator, workload and seed for all), after which the decode instance's ``/disagg/info``
gives the KV bytes moved. Workloads: ``sharegpt-multiturn`` and ``doc-mix`` (long documents
arriving while chats run; ITL of the chats is read from the report's ``by_group``). Prints
one JSON line; ``--out DIR`` keeps every bench report.

Usage: ``python -m benchmarks.fleet.bench_disagg [--deployments colocated,dp2,pd,pd-resend]
[--workloads sharegpt-multiturn,doc-mix] [--model PATH] [--quick] [--split-tokens N]
[--workload-args 'WORKLOAD=FLAGS']``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PY = sys.executable
DEPLOYMENTS = ("colocated", "dp2", "pd", "pd-resend")
WORKLOAD_ARGS = {
    "sharegpt-multiturn": "--num-conversations 8 --turns 5 --output-len 64 --max-concurrency 4",
    "doc-mix": "--num-chats 4 --turns 6 --chat-turn-len 40 --output-len 64 --num-docs 4 "
    "--doc-len 1500 --max-concurrency 5",
}
QUICK_ARGS = {
    "sharegpt-multiturn": "--num-conversations 2 --turns 3 --output-len 16 --max-concurrency 2",
    "doc-mix": "--num-chats 2 --turns 3 --chat-turn-len 20 --output-len 16 --num-docs 2 "
    "--doc-len 300 --max-concurrency 3",
}


class Fleet:
    """Processes of one deployment; every one is stopped on exit, whatever happened."""

    def __init__(self, log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, name: str, argv: list[str], cores: str | None = None) -> str:
        cmd = (["taskset", "-c", cores] if cores else []) + argv + ["--port", "0"]
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.procs.append(proc)
        deadline = time.monotonic() + 900
        for line in proc.stdout:
            if " listening on http://" in line:
                url = line.split(" listening on ")[1].split()[0]
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start; see {log.name}")
        else:
            raise RuntimeError(f"{name} exited before listening; see {log.name}")
        httpx.get(url + "/health", timeout=30).raise_for_status()
        return url

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve(model: list[str], *args: str) -> list[str]:
    return [PY, "-m", "radixserve.cli", "serve", *model, "--log-level", "warning", *args]


def router(model: list[str], *args: str) -> list[str]:
    return [PY, "-m", "radixserve.cli", "router", *model, "--log-level", "warning", *args]


EVENTS = ["--kv-events-endpoint", "tcp://127.0.0.1:0",
          "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]  # fmt: skip


def deploy(
    name: str, fleet: Fleet, model: list[str], engine: list[str], split: int | None = None
) -> tuple[str, str | None]:
    """Start deployment ``name``; return its front URL and the decode instance's (or None).
    ``split``: the conditional split's threshold (None: the instances' and router's defaults)."""
    if name == "colocated":
        return fleet.start("colocated", serve(model, *engine)), None
    engine = [*engine, *EVENTS]  # behind a router: publish KV events for its index
    if name == "dp2":
        a = fleet.start("dp-a", serve(model, *engine), cores="0")
        b = fleet.start("dp-b", serve(model, *engine), cores="1")
        return fleet.start("router", router(model, "--worker", a, "--worker", b)), None
    prefill = fleet.start(
        "prefill", serve(model, *engine, "--disaggregation-mode", "prefill"), cores="0"
    )
    endpoint = httpx.get(prefill + "/disagg/info").json()["endpoint"]
    resend = name == "pd-resend"  # every prompt through the prefill instance, whole
    if resend:
        split = 0
    extra = ["--disable-prefix-caching"] if resend else []
    if split is not None:  # the decode side's count excludes the prompt's last token
        extra += ["--remote-prefill-min-tokens", str(max(split - 1, 1))]
    decode = fleet.start(
        "decode",
        serve(model, *engine, *extra, "--disaggregation-mode", "decode",
              "--prefill-endpoint", endpoint),
        cores="1",
    )  # fmt: skip
    local = [] if split is None else ["--local-prefill-tokens", str(split)]
    front = fleet.start("router", router(model, "--prefill", prefill, "--decode", decode, *local))
    return front, decode


def run_bench(url: str, workload: str, args: str, out: Path) -> dict:
    cmd = [PY, "-m", "radixserve.cli", "bench", "--base-url", url, "--workload", workload,
           *shlex.split(args), "--output-dir", str(out), "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if not done.stdout.strip():
        raise RuntimeError(f"bench failed: {done.stderr[-2000:]}")
    results = json.loads((out / "results.json").read_text())
    [system] = results["workloads"][workload]["systems"].values()
    return system["summary"]


def figures(summary: dict, moved: dict | None) -> dict:
    keep = ("requests_ok", "requests_failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
            "itl_p99_s", "output_tokens_per_s", "requests_per_s", "cache_hit_rate",
            "by_group")  # fmt: skip
    row = {k: summary.get(k) for k in keep}
    if moved is not None:
        row["kv_bytes_moved"] = moved["bytes"]
        row["kv_transfers"] = moved["transfers_done"]
        row["kv_transfer_failures"] = moved["transfers_failed"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    ap.add_argument("--workloads", default=",".join(WORKLOAD_ARGS))
    ap.add_argument("--model", help="model file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--engine-args", default="", help="extra flags for every instance")
    ap.add_argument("--quick", action="store_true", help="tiny workloads (a smoke run)")
    ap.add_argument(
        "--split-tokens",
        type=int,
        help="pd: a prompt lacking fewer tokens on its decode instance is prefilled there "
        "(the router's --local-prefill-tokens; default: the defaults)",
    )
    ap.add_argument(
        "--workload-args",
        action="append",
        default=[],
        metavar="WORKLOAD=ARGS",
        help="replace a workload's radixserve bench flags, e.g. 'doc-mix=--num-docs 2 ...'",
    )
    ap.add_argument("--out", help="keep reports and logs here (default: a temporary dir)")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    engine = shlex.split(args.engine_args)
    table = dict(QUICK_ARGS if args.quick else WORKLOAD_ARGS)
    for item in args.workload_args:
        workload, sep, flags = item.partition("=")
        if not sep or workload not in table:
            ap.error(f"--workload-args: give WORKLOAD=ARGS with WORKLOAD in {', '.join(table)}")
        table[workload] = flags
    out_root = Path(args.out or tempfile.mkdtemp(prefix="bench-disagg-"))
    results: dict = {}
    for name in args.deployments.split(","):
        if name not in DEPLOYMENTS:
            ap.error(f"--deployments: unknown {name!r}; choose from {', '.join(DEPLOYMENTS)}")
        for workload in args.workloads.split(","):
            run_dir = out_root / f"{workload}-{name}"
            run_dir.mkdir(parents=True, exist_ok=True)
            fleet = Fleet(run_dir)
            try:
                front, decode = deploy(name, fleet, model, engine, args.split_tokens)
                summary = run_bench(front, workload, table[workload], run_dir / "report")
                moved = None
                if decode is not None:
                    moved = httpx.get(decode + "/disagg/info").json()["stats"]
                results.setdefault(workload, {})[name] = figures(summary, moved)
            except Exception as e:  # one broken deployment must not hide the others
                results.setdefault(workload, {})[name] = {"error": str(e)}
            finally:
                with contextlib.suppress(Exception):
                    fleet.stop()
    print(json.dumps({"out": str(out_root), "results": results}))


if __name__ == "__main__":
    main()
