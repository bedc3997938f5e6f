"""Speed A/B of two commits on the default model: decode at 1 and 16 streams, 2K prefill.

Method: each commit is extracted (``git archive``) into a temporary directory and served by
one long-lived worker process (its own native kernels, the default model, the engine's
defaults ``--dtype`` aside, warmed up). The parent then asks the two workers for one
measurement at a time, alternating which goes first, round after round: A and B take turns
every few hundred milliseconds, so whatever else the machine is doing at any moment falls
on both alike. Each worker measures through the engine's own ``add_request`` / ``step`` loop:

- decode, 1 stream: a 128-token prompt, ``--decode-tokens`` greedy tokens; tokens/s over the
  decode steps;
- decode, 16 streams: 16 such requests at once; aggregate tokens/s over the decode steps;
- prefill 2K: one 2,048-token prompt, one output token, in the engine's default chunks;
  prompt tokens/s from submission to the finished request.

Prompts are random token ids (a fixed seed, so both commits compute the same tokens; none is
cached). The ratio of a metric is B / A of its medians over rounds (above 1: B is faster);
``paired`` is the median of the per-round ratios. Prints one JSON line.

Usage (from the repository root)::

    python -m benchmarks.engine.ab_speed --base e037f74 --head main --rounds 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

METRICS = ("decode_1", "decode_16", "prefill_2k")
SETTLE_S = 0.05  # the other worker's compute threads stop spinning before a measurement


def measurements(dtype: str, decode_tokens: int) -> dict[str, Callable[[], float]]:
    """Each metric as a function measuring it once, with the ``radixserve`` on the path."""
    import numpy as np

    from radixserve import SamplingParams
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine

    engine = Engine(EngineConfig.from_options(dtype=dtype, max_total_tokens=16_384,
                                              load_progress=False))  # fmt: skip
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return rng.integers(100, 40_000, n).tolist()

    def decode(streams: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
        for i in range(streams):
            engine.add_request(f"d{streams}-{i}-{rng.integers(1 << 30)}", prompt(128), params)
        started: set[str] = set()
        while len(started) < streams:  # the prompts, up to every request's first token
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        decoded, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            decoded += sum(len(o.new_token_ids) for o in engine.step())
        return decoded / (time.perf_counter() - t0)

    def prefill(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        engine.add_request(f"p-{rng.integers(1 << 30)}", prompt(n), params)
        while engine.has_unfinished():
            engine.step()
        return n / (time.perf_counter() - t0)

    decode(4), prefill(256)  # warm-up: kernels, allocator, caches
    return {"decode_1": lambda: decode(1), "decode_16": lambda: decode(16),
            "prefill_2k": lambda: prefill(2048)}  # fmt: skip


def worker(dtype: str, decode_tokens: int) -> None:
    """Answer each metric name read from stdin with one measurement of it, until EOF."""
    runs = measurements(dtype, decode_tokens)
    print("ready", flush=True)
    for line in sys.stdin:
        time.sleep(SETTLE_S)
        print(json.dumps(runs[line.strip()]()), flush=True)


def extract(ref: str, root: Path) -> tuple[str, Path]:
    """``ref``'s tree in ``root/<commit>``; returns the commit's short hash and the folder."""
    commit = subprocess.run(["git", "rev-parse", "--short", ref], check=True,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    out = root / commit
    out.mkdir()
    archive = subprocess.run(["git", "archive", "--format=tar", commit], check=True,
                             capture_output=True).stdout  # fmt: skip
    tar = root / f"{commit}.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(out, filter="data")
    return commit, out


class Worker:
    """One commit's worker process."""

    def __init__(self, tree: Path, args: argparse.Namespace):
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, __file__, "--worker", "--dtype", args.dtype,
               "--decode-tokens", str(args.decode_tokens)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        self._read()  # "ready": loaded, kernels built, warmed up

    def _read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line

    def measure(self, metric: str) -> float:
        self.proc.stdin.write(metric + "\n")
        self.proc.stdin.flush()
        return float(json.loads(self._read()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def summary(va: list[float], vb: list[float]) -> dict:
    return {
        "base_median": round(statistics.median(va), 1),
        "head_median": round(statistics.median(vb), 1),
        "ratio": round(statistics.median(vb) / statistics.median(va), 4),
        "paired": round(statistics.median(y / x for x, y in zip(va, vb, strict=True)), 4),
        "base": [round(v, 1) for v in va],
        "head": [round(v, 1) for v in vb],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="e037f74", help="commit A; default %(default)s")
    p.add_argument("--head", default="main", help="commit B; default %(default)s")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--decode-tokens", type=int, default=128, help="per decode request")
    p.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.dtype, args.decode_tokens)
        return
    with tempfile.TemporaryDirectory(prefix="ab-speed-") as tmp:
        trees = dict(extract(ref, Path(tmp)) for ref in (args.base, args.head))
        (a, tree_a), (b, tree_b) = trees.items()
        workers = {a: Worker(tree_a, args)}  # one at a time: each builds its kernels
        workers[b] = Worker(tree_b, args)
        runs = {(c, m): [] for c in (a, b) for m in args.metrics}
        for r in range(args.rounds):
            for m in args.metrics:
                for commit in [a, b] if r % 2 == 0 else [b, a]:
                    runs[commit, m].append(workers[commit].measure(m))
        for w in workers.values():
            w.close()
    result = {"base": a, "head": b, "rounds": args.rounds, "dtype": args.dtype,
              "decode_tokens": args.decode_tokens}  # fmt: skip
    for m in args.metrics:
        result[m] = summary(runs[a, m], runs[b, m])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
