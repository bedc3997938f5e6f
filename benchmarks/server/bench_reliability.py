"""Reliability figures on the default model, against a real server.

1. ``/health`` latency (max and p99 of back-to-back probes) while a 10 MB prompt is being
   refused (413 by its Content-Length) and while a 4 MB prompt, just under the default
   body limit, is tokenized (on the worker thread) and refused as longer than the context.
2. Every bad-input case sent once: each must be a 400, and the engine must not restart.
3. ``kill -9`` of the engine process while two requests run: seconds until the clients get
   their error, and until ``/health`` answers 200 again (the engine restarted).

Prints one JSON line. Usage: ``python -m benchmarks.server.bench_reliability [--model PATH]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from radixserve.bench.baselines import ManagedServer, ServerSettings

ISSUE_CASES = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"temperature": 1, "top_k": 100000000000000000000}'),
    ("/v1/completions", '{"prompt": "hi", "temperature": 1, "top_k": 100000000000000000000}'),
    ("/generate", '{"text": "hi", "sampling_params": {"top_k": 100000000000000000000}}'),
    ("/generate", '{"text": "hi", "sampling_params": {"max_tokens": 4, "logprobs": 2.5}}'),
    ("/generate", '{"text": "hi", "sampling_params": {"max_tokens": 4, "logprobs": true}}'),
    ("/generate", '{"text": "hi", "sampling_params": {"max_tokens": 4, "logprobs": 0.5}}'),
    ("/v1/completions", '{"prompt": "a\\ud800b"}'),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}'),
    ("/v1/completions", '{"prompt": "hi", "repetition_penalty": NaN}'),
    ("/v1/completions", '{"prompt": "hi", "seed": 18446744073709551616}'),
    ("/generate", '{"text": "hi", "sampling_params": {"stop": {"a": 1}}}'),
    ("/v1/completions", '{"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "n": 16}'),
]  # fmt: skip


def health_while(url: str, action) -> tuple[object, list[float]]:
    """Run ``action()`` while probing /health back to back; its result and the latencies."""
    done, latencies = threading.Event(), []

    def probe() -> None:
        with httpx.Client() as client:
            while not done.is_set():
                t0 = time.perf_counter()
                client.get(url + "/health").raise_for_status()
                latencies.append(time.perf_counter() - t0)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        prober = pool.submit(probe)
        time.sleep(0.2)
        try:
            result = action()
        finally:
            done.set()
        prober.result()
    return result, latencies


def summary(latencies: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[int(0.99 * (len(ms) - 1))]
    return {"probes": len(ms), "max_ms": round(ms[-1], 1), "p99_ms": round(p99, 1),
            "median_ms": round(statistics.median(ms), 1)}  # fmt: skip


def post(url: str, path: str, content: str | bytes, timeout: float = 300) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(url + path, content=content, headers=headers, timeout=timeout)


def engine_pid(server_pid: int) -> int:
    for pid in open(f"/proc/{server_pid}/task/{server_pid}/children").read().split():
        if "spawn_main" in open(f"/proc/{pid}/cmdline").read():
            return int(pid)
    raise LookupError("no engine process")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a .gguf file or HF directory (default: the default model)")
    args = p.parse_args()
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as logs:
        settings = ServerSettings(model=args.model, log_dir=Path(logs))
        model = ["--model", args.model] if args.model else []
        argv = lambda port: [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port),
                             *model]  # fmt: skip
        with ManagedServer("radixserve", argv, settings) as server:
            url = server.base_url
            ten_mb = json.dumps({"prompt": "word " * (2 * 2**20)})
            r, lat = health_while(url, lambda: post(url, "/v1/completions", ten_mb).status_code)
            out["health_during_10MB_prompt"] = {"status": r, **summary(lat)}
            four_mb = json.dumps({"prompt": "word " * (4 * 2**20 // 5 - 100)})
            t0 = time.perf_counter()
            r, lat = health_while(url, lambda: post(url, "/v1/completions", four_mb).status_code)
            took = round(time.perf_counter() - t0, 2)
            out["health_during_4MB_prompt"] = {"status": r, "request_s": took, **summary(lat)}
            codes = [post(url, path, body).status_code for path, body in ISSUE_CASES]
            metrics = httpx.get(url + "/metrics").text
            restarts = next(float(line.split()[-1]) for line in metrics.splitlines()
                            if line.startswith("engine_restarts_total"))  # fmt: skip
            out["issue_cases"] = {"statuses": codes, "engine_restarts": restarts}

            long = json.dumps({"prompt": "hi", "max_tokens": 2000, "ignore_eos": True})
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                running = [pool.submit(post, url, "/v1/completions", long) for _ in range(2)]
                time.sleep(3)
                killed = time.monotonic()
                os.kill(engine_pid(server.proc.pid), signal.SIGKILL)
                statuses = [f.result().status_code for f in running]
                errors_after = time.monotonic() - killed
            while httpx.get(url + "/health").status_code != 200:
                time.sleep(0.1)
            out["kill_9"] = {"client_statuses": statuses, "errors_after_s": round(errors_after, 2),
                             "health_200_after_s": round(time.monotonic() - killed, 1)}  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
