"""The simulator against a real run: same workloads, same engine settings, on this machine.

Method: fit a timing model to the default model's engine in this process (``fit_engine``),
start a real ``radixserve serve`` of the same model and settings with a step trace, calibrate
the model to the engine as it serves (``calibrate_served``: short and long random prompts one
at a time, short ones 4 at a time: a workload unlike the two compared), then run two
``radixserve bench`` workloads against it (shared system prompts; few-shot prompts) and
simulate the same workloads. A trace carries what a request generates, so the simulated
requests generate as many tokens as the real ones did; everything else (cache hits, queueing,
step times) is the simulator's prediction. The bar: hit rate within 2 percentage
points and TTFT p50 within 20% of the real run. A shared machine's speed drifts by 10-40%
from one minute to the next, so the whole cycle (calibration, then both workloads, each
simulated with that calibration) runs three times and the medians over the rounds are
compared; every round's hit rates must match.
"""

from pathlib import Path

import numpy as np
import pytest

from radixserve.bench import baselines
from radixserve.bench.loadgen import LoadConfig, run_load
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.engine.step_trace import read_step_trace
from radixserve.sim.fit import fit_engine
from radixserve.sim.loop import SimConfig, Simulation
from radixserve.sim.metrics import summarize
from radixserve.sim.served import calibrate_served, engine_request_id
from radixserve.sim.trace import Turn
from radixserve.sim.workloads import bench_trace

KV_TOKENS = 20_000
CONCURRENCY = 4
ROUNDS = 3  # calibration and both workloads, three times: the machine's speed drifts
WORKLOADS = {
    "shared-prefix": dict(num_groups=2, prompts_per_group=14, system_prompt_len=200,
                          question_len=16, output_len=8),
    "few-shot": dict(dataset_path=str(Path(__file__).parent / "fixtures/arithmetic.jsonl"),
                     num_shots=4, num_questions=28, output_len=8),
}  # fmt: skip


def real_run(base_url: str, name: str, params: dict):
    from radixserve.bench.workloads import build_workload

    workload = build_workload(name, 0, **params)
    load = LoadConfig(base_url=base_url, max_concurrency=CONCURRENCY, warmup_requests=2,
                      metrics_interval=0, progress=False)  # fmt: skip
    records = run_load(workload, load).records
    assert all(r.success for r in records), [r.error for r in records if not r.success]
    hit = sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
    return records, hit, float(np.median([r.ttft for r in records]))


def simulated_run(tokenizer, name, params, records, timing, engine_config):
    trace = bench_trace(tokenizer, name, 0, **params)
    produced = {(r.conversation_id, r.turn): r.output_tokens for r in records}
    for s in trace.sessions:  # each request generates what the real one generated
        s.turns = [Turn(t.prompt, t.output[: produced[(s.id, k + 1)]], t.think_time)
                   for k, t in enumerate(s.turns)]  # fmt: skip
    config = SimConfig(engine_config, 1, max_concurrency=CONCURRENCY, check_integrity=True)
    result = Simulation(trace, config, timing).run()
    row, rec = summarize(result), result.records
    parts = dict(sim_engine=float(np.median(rec.first_token - rec.arrival)),
                 sim_outside=float(np.median(rec.outside)))  # fmt: skip
    return row["hit_rate"], row["ttft_p50_s"], parts


def engine_times(trace_path, records) -> dict:
    """The real run's median engine part of TTFT (sent to the engine -> first token)."""
    trace = read_step_trace(trace_path)
    parts = [trace.requests[engine_request_id(r.response_id)] for r in records]
    return dict(real_engine=float(np.median([p.first_token - p.sent for p in parts])))


@pytest.fixture(scope="module")
def validation_model(default_gguf) -> str:
    """The default model, SmolLM2-135M: what the simulator's profiles are for. (The tiny test
    model was tried too: its TTFT of about 40 ms is all front end and Python, and the real
    run's own median moves by +-20% from one run to the next on this machine; see
    docs/decisions.md.)"""
    return str(default_gguf)


@pytest.fixture(scope="module")
def fitted(validation_model):
    config = EngineConfig.from_options(
        model=validation_model, dtype="float32", max_total_tokens=KV_TOKENS, load_progress=False
    )
    timing = fit_engine(Engine(config), 512, 1, statistic="median", plan="quick")
    return config, timing


@pytest.mark.slow  # a fit, a real server and two bench runs: minutes on 2 cores
def test_simulator_predicts_a_real_bench_run(validation_model, default_tokenizer, fitted, tmp_path):
    engine_config, timing = fitted
    trace = tmp_path / "steps.jsonl"
    settings = baselines.ServerSettings(
        model=validation_model, slots=CONCURRENCY, log_dir=tmp_path,
        radix_args=("--dtype", "float32", "--max-total-tokens", str(KV_TOKENS),
                    "--step-trace", str(trace)),
    )  # fmt: skip
    rounds: list[dict] = []
    with baselines.ManagedServer("sim-validation", baselines.command("radix", settings),
                                 settings) as server:  # fmt: skip
        for _ in range(ROUNDS):
            calibration = calibrate_served(server.base_url, trace, timing, CONCURRENCY)
            served = calibration.apply(timing)
            results = {"calibration": calibration.summary()}
            for name, params in WORKLOADS.items():
                records, hit, ttft = real_run(server.base_url, name, params)
                sim_hit, sim_ttft, parts = simulated_run(
                    default_tokenizer, name, params, records, served, engine_config
                )
                results[name] = dict(real_hit=hit, sim_hit=sim_hit, real_ttft=ttft,
                                     sim_ttft=sim_ttft, **parts,
                                     **engine_times(trace, records))  # fmt: skip
            rounds.append(results)
    for r in rounds:
        print(f"\n{r}")
    for name in WORKLOADS:
        real_ttft = float(np.median([r[name]["real_ttft"] for r in rounds]))
        sim_ttft = float(np.median([r[name]["sim_ttft"] for r in rounds]))
        print(f"{name}: TTFT p50 real {real_ttft * 1e3:.1f} ms, simulated {sim_ttft * 1e3:.1f} ms")
        for r in rounds:
            got = r[name]
            assert got["real_hit"] > 0.3, f"{name}: the workload should reuse prefixes: {got}"
            assert abs(got["sim_hit"] - got["real_hit"]) <= 0.02, f"{name}: hit rate {got}"
        assert abs(sim_ttft - real_ttft) <= 0.2 * real_ttft, f"{name}: TTFT {rounds}"
