"""The engine as it serves: calibrate a fitted timing model on a real server's step trace.

``fit.fit_engine`` times steps in a tight loop, one process with the machine to itself. A
served engine runs beside the HTTP process and the clients: every token it streams costs the
front end work, which on a CPU machine competes with the engine's threads, and every request
spends time outside the engine (HTTP, chat template, tokenizing, the hop to the engine
process, streaming back) that grows with the streams the front end is serving at once.

``calibrate_served`` measures both on a running ``radixserve serve --step-trace PATH``: the
bench's load generator sends short random prompts one at a time, then ``concurrency`` at a
time, and the step trace (``engine/step_trace.py``) says when each request reached the engine,
when its first token was computed and what every step computed. Then:

- ``served_scale``: the median over the traced steps of measured / predicted step time; every
  step coefficient is multiplied by it.
- outside time of a request: its TTFT at the client minus its engine time (first-token step
  end minus the moment the HTTP side sent it to the engine), matched by the response id;
  ``request_overhead`` is its median one at a time, and ``request_overhead_per_stream`` how
  much the median grows per request already in flight at the server when it was sent:
  ``(median outside at concurrency C - request_overhead) / median streams in flight``.

The calibration workload is unlike the ones a simulation is checked against (random prompts,
no shared prefixes), so a check on other workloads is a prediction, not a refit.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path

from radixserve.engine.step_trace import StepTrace, read_step_trace
from radixserve.sim.timing import TimingModel

CALIBRATION_REQUESTS = 24  # per concurrency
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 8


@dataclass
class Calibration:
    served_scale: float
    request_overhead: float
    request_overhead_per_stream: float
    steps: int
    requests: dict[int, int]  # concurrency -> requests matched in the trace
    outside_median: dict[int, float]  # concurrency -> median outside time (s)
    streams_median: dict[int, float]  # concurrency -> median requests in flight when sent

    def apply(self, timing: TimingModel) -> TimingModel:
        """``timing`` with its steps scaled and the request overheads measured here."""
        served = timing.scaled(self.served_scale)
        served.request_overhead = self.request_overhead
        served.request_overhead_per_stream = self.request_overhead_per_stream
        served.meta = {**timing.meta, "served": self.summary()}
        return served

    def summary(self) -> dict:
        return {
            "served_scale": self.served_scale,
            "steps": self.steps,
            "requests": self.requests,
            "outside_median_s": self.outside_median,
            "streams_median": self.streams_median,
        }


def engine_request_id(response_id: str) -> str:
    """The engine's id of a response's first sequence (``server/serving.py``)."""
    return f"{response_id.rsplit('-', 1)[-1]}-0"


def run_calibration_load(base_url: str, concurrency: int, seed: int):
    from radixserve.bench.loadgen import LoadConfig, run_load
    from radixserve.bench.workloads import build_workload

    workload = build_workload(
        "random", seed, num_prompts=CALIBRATION_REQUESTS, input_len=PROMPT_TOKENS,
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
    runs = {c: run_calibration_load(base_url, c, seed=c) for c in (1, concurrency)}
    trace = read_step_trace(trace_path)
    ratios = [s.seconds / timing.step_time(s.prefills, s.decodes) for s in trace.steps]
    if not ratios:
        raise RuntimeError(f"the step trace {trace_path} has no steps: is --step-trace on?")
    scale = statistics.median(ratios)
    streams = streams_in_flight(trace)
    outside: dict[int, list[float]] = {}
    in_flight: dict[int, list[int]] = {}
    for c, records in runs.items():
        for r in records:
            traced = trace.requests.get(engine_request_id(r.response_id or ""))
            if traced is None or traced.first_token is None or r.ttft is None:
                continue
            outside.setdefault(c, []).append(r.ttft - (traced.first_token - traced.sent))
            in_flight.setdefault(c, []).append(streams[engine_request_id(r.response_id)])
    if set(outside) != set(runs):
        raise RuntimeError("the step trace does not show the calibration requests")
    med = {c: statistics.median(v) for c, v in outside.items()}
    busy = {c: statistics.median(v) for c, v in in_flight.items()}
    base = max(0.0, med[1])
    extra = med[concurrency] - base
    per_stream = max(0.0, extra / busy[concurrency]) if busy[concurrency] > 0 else 0.0
    return Calibration(scale, base, per_stream, len(trace.steps),
                       {c: len(v) for c, v in outside.items()}, med, busy)  # fmt: skip
