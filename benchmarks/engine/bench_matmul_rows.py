"""The native matmul on a model's own matrices: time per call by row count and path.

Method. Loads a model (default: Qwen2.5-Coder-0.5B Q4_K_M) with its weights kept quantized
and times ``qgemm`` on layer 0's fused QKV, output and fused gate/up, the down projections of
layers 0 and 1 (each counted for half the layers), and the LM head, for each ``--rows`` count
(x random): both the path without int8 (``float``: float lanes from 8 rows, int16 dot
products below) and the int8 path (x rounded to int8 per block, what the decoder and the
prompt path use for GGUF block formats, and the decoder's batches for every format), one
after the other on each matrix, best of ``--repeat`` timings each. ``step_ms`` adds the
matrices up as a decode step runs them (every layer, the LM head once). ``int8_alone`` is
the int8 path with every row computed on its own (``alone=True``: what a step of fewer than
8 sequences takes for a draft's rows, each weight read once for all rows), and
``verify_vs_decode`` its step time over that many one-row steps: what verifying ``rows - 1``
drafted tokens costs against decoding them one step each (1.0: no gain at all; 1/rows: free).
Threads: ``OMP_NUM_THREADS``; ``--clock cpu`` times CPU time, not wall time. Prints one JSON
line.

Usage: ``python -m benchmarks.engine.bench_matmul_rows [--model NAME] [--rows 1 16]``
(``RADIXSERVE_NATIVE_ISA=avx2`` for the AVX2-only build).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from radixserve.model import native
from radixserve.model.loader import load_model


def best_ms(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time (with OMP_NUM_THREADS=1, time spent "
                        "descheduled on a busy machine does not count)")  # fmt: skip
    args = parser.parse_args()
    ops = native.paged_ops()
    if ops is None:
        raise SystemExit("the native kernels did not build on this machine")
    model = load_model(args.model, progress=False, dtype="float32").model
    layers = model.layers
    n = len(layers)
    # (name, weight, how many of it a decode step multiplies)
    mats = [("qkv", layers[0]["qkv"], n), ("o", layers[0]["o"], n),
            ("gate_up", layers[0]["gate_up"], n), ("down_0", layers[0]["down"], (n + 1) // 2),
            ("down_1", layers[1]["down"], n // 2), ("lm_head", model.lm_head, 1)]  # fmt: skip
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    out: dict = {"bench": "matmul_rows", "clock": args.clock, "model": args.model,
                 "threads": torch.get_num_threads()}  # fmt: skip
    for m in args.rows:
        paths = ("float", "int8", "int8_alone")
        row: dict = {p: {"step_ms": 0.0} for p in paths}
        for name, w, count in mats:
            view = w.native_view()
            x = torch.randn(m, w.shape[1])
            for path in paths:
                int8, alone = path != "float", path == "int8_alone"
                ms = best_ms(lambda v=view, x=x, i=int8, a=alone: ops.qgemm(x, v, int8=i, alone=a),
                             args.repeat, clock)  # fmt: skip
                row[path][name] = round(ms, 3)
                row[path]["step_ms"] += ms * count
        for path in paths:
            row[path]["step_ms"] = round(row[path]["step_ms"], 2)
        row["int8_speedup"] = round(row["float"]["step_ms"] / row["int8"]["step_ms"], 2)
        out[f"rows_{m}"] = row
    one = out.get("rows_1")
    if one is not None:
        out["verify_vs_decode"] = {
            str(m): round(out[f"rows_{m}"]["int8_alone"]["step_ms"]
                          / (m * one["int8"]["step_ms"]), 3)
            for m in args.rows
        }  # fmt: skip
    out["isa"] = os.environ.get("RADIXSERVE_NATIVE_ISA", "native")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
