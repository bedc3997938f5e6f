"""The engine as it serves: calibrate a fitted timing model on a real server's step trace.

``fit.fit_engine`` times steps in a tight loop, one process with the machine to itself. A
served engine runs beside the HTTP process and the clients: every token it streams costs the
front end work, which on a CPU machine competes with the engine's threads, and every request
spends time outside the engine (HTTP, chat template, tokenizing, the hop to the engine
process, streaming back) that grows with its prompt and with the streams the front end is
serving at once.

``calibrate_served`` measures both on a running ``radixserve serve --step-trace PATH``. The
bench's load generator sends random prompts: short ones one at a time, long ones one at a
time, then short ones ``concurrency`` at a time; the step trace (``engine/step_trace.py``)
says when each request reached the engine, when its first token was computed and what every
step computed. Then:

- ``served_scale``: the median over the traced steps of measured / predicted step time; every
  step coefficient is multiplied by it.
- outside time of a request: its TTFT at the client minus its engine time (first-token step
  end minus the moment the HTTP side sent it to the engine), matched by the response id.
  One at a time, its medians for short and long prompts give ``request_overhead`` and
  ``request_overhead_per_token`` (a line through the two); at ``concurrency``, how far its
  median lies above that line, per request already in flight when it was sent (median), is
  ``request_overhead_per_stream``.

The calibration workload is unlike the ones a simulation is checked against (random prompts,
no shared prefixes), so a check on other workloads is a prediction, not a refit.
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path

from radixserve.engine.step_trace import StepTrace, read_step_trace
from radixserve.sim.timing import TimingModel

CALIBRATION_REQUESTS = 24  # per run
SHORT_PROMPT, LONG_PROMPT = 32, 384  # words (about as many tokens)
OUTPUT_TOKENS = 8


@dataclass
class Calibration:
    served_scale: float
    request_overhead: float
    request_overhead_per_token: float
    request_overhead_per_stream: float
    steps: int
    runs: dict[str, dict[str, float]]  # run -> requests, medians of outside time, prompt, streams

    def apply(self, timing: TimingModel) -> TimingModel:
        """``timing`` with its steps scaled and the request overheads measured here."""
        served = timing.scaled(self.served_scale)
        served.request_overhead = self.request_overhead
        served.request_overhead_per_token = self.request_overhead_per_token
        served.request_overhead_per_stream = self.request_overhead_per_stream
        served.meta = {**timing.meta, "served": self.summary()}
        return served

    def summary(self) -> dict:
        return {"served_scale": self.served_scale, "steps": self.steps, "runs": self.runs}


def engine_request_id(response_id: str) -> str:
    """The engine's id of a response's first sequence (``server/serving.py``)."""
    return f"{response_id.rsplit('-', 1)[-1]}-0"


def run_calibration_load(base_url: str, concurrency: int, prompt_words: int, seed: int):
    from radixserve.bench.loadgen import LoadConfig, run_load
    from radixserve.bench.workloads import build_workload

    workload = build_workload(
        "random", seed, num_prompts=CALIBRATION_REQUESTS, input_len=prompt_words,
        output_len=OUTPUT_TOKENS,
    )  # fmt: skip
    load = LoadConfig(base_url=base_url, max_concurrency=concurrency, warmup_requests=2,
                      metrics_interval=0, progress=False)  # fmt: skip
    records = run_load(workload, load).records
    bad = [r.error for r in records if not r.success]
    if bad:
        raise RuntimeError(f"calibration requests failed: {bad[:3]}")
    return records


def streams_in_flight(trace: StepTrace) -> dict[str, int]:
    """For each traced request: how many others were at the engine (sent, not finished)
    when it was sent."""
    reqs = [r for r in trace.requests.values() if r.finished is not None]
    sent = sorted(r.sent for r in reqs)
    done = sorted(r.finished for r in reqs)
    return {
        rid: bisect_left(sent, r.sent) - bisect_right(done, r.sent)
        for rid, r in trace.requests.items()
    }


def calibrate_served(
    base_url: str, trace_path: str | Path, timing: TimingModel, concurrency: int = 4
) -> Calibration:
    if concurrency < 2:
        raise ValueError(f"concurrency must be at least 2, got {concurrency}")
    since = time.monotonic()  # a trace may hold earlier traffic: only this calibration's steps
    plan = {
        "short": (1, SHORT_PROMPT),
        "long": (1, LONG_PROMPT),
        "busy": (concurrency, SHORT_PROMPT),
    }
    records = {name: run_calibration_load(base_url, c, words, seed=k)
               for k, (name, (c, words)) in enumerate(plan.items())}  # fmt: skip
    trace = read_step_trace(trace_path)
    steps = [s for s in trace.steps if s.start >= since]
    ratios = [s.seconds / timing.step_time(s.prefills, s.decodes) for s in steps]
    if not ratios:
        raise RuntimeError(f"the step trace {trace_path} has no steps: is --step-trace on?")
    streams = streams_in_flight(trace)
    runs: dict[str, dict[str, float]] = {}
    for name, recs in records.items():
        rows = []
        for r in recs:
            rid = engine_request_id(r.response_id or "")
            traced = trace.requests.get(rid)
            if traced is None or traced.first_token is None or r.ttft is None:
                continue
            outside = r.ttft - (traced.first_token - traced.sent)
            rows.append((outside, r.prompt_tokens or 0, streams[rid]))
        if not rows:
            raise RuntimeError(f"the step trace does not show the {name!r} calibration requests")
        outside, prompt, busy = (statistics.median(col) for col in zip(*rows, strict=True))
        runs[name] = {"requests": len(rows), "outside_s": outside, "prompt_tokens": prompt,
                      "streams": busy}  # fmt: skip
    short, long, busy = runs["short"], runs["long"], runs["busy"]
    span = long["prompt_tokens"] - short["prompt_tokens"]
    per_token = max(0.0, (long["outside_s"] - short["outside_s"]) / span) if span > 0 else 0.0
    base = max(0.0, short["outside_s"] - per_token * short["prompt_tokens"])
    above = busy["outside_s"] - (base + per_token * busy["prompt_tokens"])
    per_stream = max(0.0, above / busy["streams"]) if busy["streams"] > 0 else 0.0
    return Calibration(statistics.median(ratios), base, per_token, per_stream,
                       len(steps), runs)  # fmt: skip
