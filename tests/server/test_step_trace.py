"""The step trace (``serve --step-trace``) and what the simulator's served calibration reads
from it: the engine loop writes admissions and steps; the trace says what each step computed
and when each request got its first token."""

import time

import pytest
from test_validation import Recorder, add_message, outputs_of

from radixserve.engine import SamplingParams
from radixserve.engine.step_trace import StepTraceWriter, read_step_trace
from radixserve.server.engine_process import EngineLoop
from radixserve.sim.served import Calibration, engine_request_id, streams_in_flight
from radixserve.sim.timing import TimingModel


def run_traced(make_engine, path, requests, **options):
    engine = make_engine(**options)
    writer = StepTraceWriter(path)
    push = Recorder()
    loop = EngineLoop(engine, None, push, trace=writer)
    sent = {}
    for rid, prompt, max_tokens in requests:
        sent[rid] = time.monotonic()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        loop.handle(add_message(rid, prompt, params, sent[rid]))
    while engine.has_unfinished():
        loop.step()
    writer.close()
    return read_step_trace(path), outputs_of(push.sent), sent


def test_trace_records_what_every_step_computed_and_each_requests_times(make_engine, tmp_path):
    trace, outputs, sent = run_traced(
        make_engine, tmp_path / "t.jsonl", [("a", list(range(5, 25)), 3), ("b", [7, 8, 9], 2)]
    )
    # both prompts are prefilled in the first step, from position 0; then "a" and "b" decode
    first = trace.steps[0]
    assert sorted(first.prefills) == [(3, 0), (20, 0)] and first.decodes == []
    assert sorted(trace.steps[1].decodes) == [3, 20]  # one token each, at their contexts
    assert trace.steps[-1].decodes == [21]  # "a" alone: its third token
    assert sum(len(s.decodes) for s in trace.steps) == (3 - 1) + (2 - 1)
    assert all(s.end >= s.start for s in trace.steps)
    a, b = trace.requests["a"], trace.requests["b"]
    assert a.sent == sent["a"] and a.received >= a.sent
    assert a.first_token == b.first_token == first.end
    assert b.finished == trace.steps[1].end and a.finished == trace.steps[-1].end
    assert [o.request_id for o in outputs if o.finished] == ["b", "a"]
    # in flight when sent: "a" found nobody, "b" found "a"
    assert streams_in_flight(trace) == {"a": 0, "b": 1}


def test_trace_records_the_tier_moves_of_each_step(make_engine, tmp_path):
    shared = list(range(100, 164))  # four pages, evicted to the host, then loaded back
    fill = [[7000 + 100 * i + j for j in range(64)] for i in range(3)]
    requests = [("a", shared + [5], 2)] + [(f"f{i}", f, 2) for i, f in enumerate(fill)]
    trace, _, _ = run_traced(
        make_engine, tmp_path / "t.jsonl", [*requests, ("b", shared + [6], 2)], page_size=16,
        max_total_tokens=160, host_kv_memory="1MiB", chunked_prefill_size=80,
        max_running_requests=1, load_back_min_tokens=16, schedule_policy="fcfs",
    )  # fmt: skip
    moved = [s.tiers for s in trace.steps if s.tiers is not None]
    assert len(moved) == len(trace.steps) - 1  # every step after the first says what moved
    assert sum(t.backed_up_tokens for t in moved) >= 64  # write_back: "a" copied on eviction
    loads = [t for t in moved if t.loads]
    assert len(loads) == 1 and loads[0].loaded_tokens == 64 and loads[0].load_s > 0
    assert all(t.backup_s >= 0 and t.pages_to_storage == 0 for t in moved)


def test_trace_is_off_by_default_and_a_torn_last_line_is_skipped(make_engine, tmp_path):
    engine = make_engine()
    loop = EngineLoop(engine, None, Recorder())
    assert engine.record_step_shape is False
    loop.handle(add_message("x", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)))
    loop.step()
    assert engine.last_step_shape is None
    path = tmp_path / "t.jsonl"
    path.write_text('{"add":"x","sent":1.0,"received":1.5}\n{"step":[2.0,')
    trace = read_step_trace(path)
    assert trace.requests["x"].sent == 1.0 and trace.steps == []


def test_served_calibration_scales_steps_and_sets_the_outside_time():
    timing = TimingModel(overhead=1e-3, prefill_token=1e-4, decode_request=2e-4,
                         request_overhead=0.5, meta={"fit": 1})  # fmt: skip
    cal = Calibration(served_scale=2.0, request_overhead=0.01, request_overhead_per_token=1e-5,
                      request_overhead_per_stream=0.004, steps=10, runs={})  # fmt: skip
    served = cal.apply(timing)
    assert served.step_time([(10, 0)], [5]) == pytest.approx(2 * timing.step_time([(10, 0)], [5]))
    assert served.outside_time(0, 0) == 0.01
    assert served.outside_time(100, 3) == pytest.approx(0.01 + 0.001 + 0.012)
    assert served.meta["fit"] == 1 and served.meta["served"]["served_scale"] == 2.0
    assert engine_request_id("chatcmpl-0123abcd") == "0123abcd-0"


def test_serve_step_trace_flag_errors_name_it(capsys, tmp_path):
    from radixserve.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--step-trace", str(tmp_path / "no" / "dir" / "t.jsonl")])
    assert "--step-trace: cannot write" in capsys.readouterr().err
