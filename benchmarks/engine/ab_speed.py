"""Speed A/B of two commits on the default model: decode at 1 and 16 streams, 2K prefill.

Method: each commit is extracted (``git archive``) into a temporary directory; every round runs
one fresh Python process per commit, alternating A, B, B, A, A, B, ... so drift in the
machine's speed falls on both alike. A process loads the default model with the engine's
defaults (``--dtype`` aside), builds or loads that commit's native kernels, warms up, and
measures through the engine's own ``add_request`` / ``step`` loop:

- decode, 1 stream: a 128-token prompt, ``--decode-tokens`` greedy tokens; tokens/s over the
  decode steps;
- decode, 16 streams: 16 such requests at once; aggregate tokens/s over the decode steps;
- prefill 2K: one 2,048-token prompt, one output token, in the engine's default chunks;
  prompt tokens/s from submission to the finished request.

A process measures each metric ``--repeats`` times and reports the best (interference only
ever slows a run down, so the best is the least disturbed).

Prompts are random token ids (a fixed seed, so both commits compute the same tokens; none is
cached). The ratio of a metric is B / A of its medians over rounds (above 1: B is faster);
``paired`` is the median of the per-round ratios. Prints one JSON line.

Usage (from the repository root)::

    python -m benchmarks.engine.ab_speed --base e037f74 --head main --rounds 6
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
from pathlib import Path

METRICS = ("decode_1", "decode_16", "prefill_2k")


def child(dtype: str, decode_tokens: int, repeats: int) -> dict[str, float]:
    """One measurement of every metric with the ``radixserve`` on the path (runs in a child)."""
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
    runs = {"decode_1": lambda: decode(1), "decode_16": lambda: decode(16),
            "prefill_2k": lambda: prefill(2048)}  # fmt: skip
    return {name: max(run() for _ in range(repeats)) for name, run in runs.items()}


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


def run_child(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype,
           "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="e037f74", help="commit A; default %(default)s")
    p.add_argument("--head", default="main", help="commit B; default %(default)s")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--decode-tokens", type=int, default=64, help="per decode request")
    p.add_argument("--repeats", type=int, default=1, help="per metric and process; the best")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.dtype, args.decode_tokens, args.repeats)))
        return
    with tempfile.TemporaryDirectory(prefix="ab-speed-") as tmp:
        trees = dict(extract(ref, Path(tmp)) for ref in (args.base, args.head))
        (a, tree_a), (b, tree_b) = trees.items()
        for tree in (tree_a, tree_b):  # build each commit's kernels before timing anything
            run_child(tree, args)
        runs: dict[str, list[dict[str, float]]] = {a: [], b: []}
        for r in range(args.rounds):
            order = [a, b] if r % 2 == 0 else [b, a]
            for commit in order:
                runs[commit].append(run_child(trees[commit], args))
    result = {"base": a, "head": b, "rounds": args.rounds, "dtype": args.dtype,
              "decode_tokens": args.decode_tokens, "repeats": args.repeats}  # fmt: skip
    for m in METRICS:
        va, vb = [x[m] for x in runs[a]], [x[m] for x in runs[b]]
        result[m] = {
            "base_median": round(statistics.median(va), 1),
            "head_median": round(statistics.median(vb), 1),
            "ratio": round(statistics.median(vb) / statistics.median(va), 4),
            "paired": round(statistics.median(y / x for x, y in zip(va, vb, strict=True)), 4),
            "base": [round(v, 1) for v in va],
            "head": [round(v, 1) for v in vb],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
