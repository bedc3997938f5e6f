"""Where a decode instance should prefill a prompt itself: the measurement behind the default
of ``--remote-prefill-min-tokens`` (the conditional split of prefill/decode disaggregation).

A decode instance that prefills ``k`` uncached prompt tokens itself puts them into the same
step as its running decodes, so every running request waits for them. Sending them to a
prefill instance instead costs the decode instance only the landing of ``k`` tokens' KV (one
scatter per layer) plus one more row in the decode batch (the prompt's last token, computed
here for its logits), and costs the request a round trip. On the default model, one thread
(a decode instance on one core), with ``--batch`` running requests at ``--context`` tokens:

- ``decode_step``: a step of the running decodes alone;
- ``local[k]``: the same step with a ``k``-token prefill chunk in it;
- ``remote[k]``: a step with one more decode row, plus landing ``k`` tokens of KV.

Steps are timed interleaved, median of ``--repeat``. The threshold is the largest ``k`` whose
local prefill adds at most one decode step to the step (running requests see at most one
doubled inter-token gap): below it the decode instance computes the prompt itself. Prints
one JSON line. Usage: ``python -m benchmarks.fleet.bench_disagg_threshold [--repeat 15]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from benchmarks.common import median_seconds
from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.disagg import wire
from radixserve.disagg.transfer import KVLayout
from radixserve.engine import Engine
from radixserve.model import load_model

SIZES = (8, 16, 32, 48, 64, 96, 128, 192, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, progress=False)
    engine = Engine(
        EngineConfig.from_options(
            load_progress=False, max_total_tokens=32768, chunked_prefill_size=4096
        ),
        loaded,
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(args.batch + 1):  # one spare: the "one more decode row" of the remote path
        engine.add_request(f"d{i}", rng.integers(100, 40000, args.context).tolist(), params)
    while engine.stats().num_running < args.batch + 1 or any(
        r.num_uncomputed > 1 for r in engine.scheduler.running
    ):
        engine.step()
    spare = engine.requests["d0"]
    sched = engine.scheduler
    layout = KVLayout.of_pool(engine.pool, "bench", 1)
    per_layer = layout.bytes_per_token_layer()

    def decode_only() -> float:
        sched.running.remove(spare)  # the batch without the spare row
        try:
            return median_seconds(engine.step)
        finally:
            sched.running.append(spare)

    def with_prefill(k: int) -> float:
        rid = f"p{time.monotonic_ns()}"
        engine.add_request(rid, rng.integers(100, 40000, k).tolist(), SamplingParams(max_tokens=1))
        sched.running.remove(spare)
        try:
            return median_seconds(engine.step)
        finally:
            sched.running.append(spare)
            engine.abort_request(rid)

    def remote(k: int) -> float:
        slots = torch.arange(30000, 30000 + k)  # free slots, far from the running requests
        frame = np.zeros(layout.num_layers * k * per_layer, dtype=np.uint8)
        landing = median_seconds(
            lambda: wire.scatter(
                engine.pool, slots, 0, layout.num_layers, memoryview(frame), memoryview(frame),
                layout,
            )
        )  # fmt: skip
        return landing + median_seconds(engine.step)  # the full batch: the spare is the extra row

    samples: dict[str, list[float]] = {"decode_step": []}
    for _ in range(args.repeat):
        samples["decode_step"].append(decode_only())
        for k in SIZES:
            samples.setdefault(f"local_{k}", []).append(with_prefill(k))
            samples.setdefault(f"remote_{k}", []).append(remote(k))
            samples["decode_step"].append(decode_only())
    med = {name: statistics.median(v) for name, v in samples.items()}
    step = med["decode_step"]
    rows = {
        k: {
            "local_extra_ms": round(1000 * (med[f"local_{k}"] - step), 2),
            "remote_extra_ms": round(1000 * (med[f"remote_{k}"] - step), 2),
        }
        for k in SIZES
    }
    under = [k for k in SIZES if med[f"local_{k}"] - step <= step]
    print(
        json.dumps(
            {
                "model": engine.model_name,
                "threads": args.threads,
                "batch": args.batch,
                "context": args.context,
                "decode_step_ms": round(1000 * step, 2),
                "per_prompt_tokens": rows,
                "threshold_tokens": max(under) if under else 0,
            }
        )
    )


if __name__ == "__main__":
    main()
