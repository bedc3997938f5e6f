"""The simulator: it runs the engine's own scheduler and tree, its shortcuts change nothing,
traces load, Belady bounds every online policy, and the CLI writes its reports."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from radixserve.cache import PagedAllocator
from radixserve.cache.eviction import EVICTION_POLICIES
from radixserve.cache.kv_pool import KVShape
from radixserve.cache.window_pages import WindowedAllocator
from radixserve.cli import main
from radixserve.config import EngineConfig
from radixserve.engine.core import EngineCore, Limits
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.spec import RequestSpec
from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.sim.instance import TimingExecutor, sim_cache
from radixserve.sim.loop import SimConfig, Simulation
from radixserve.sim.metrics import summarize
from radixserve.sim.replay import replay, replay_order, slot_replay
from radixserve.sim.routing import ROUTING_POLICIES, RoutingConfig, SimRouter
from radixserve.sim.timing import (
    DEFAULT_PROFILE,
    TimingModel,
    fit_coefficients,
    shipped_profiles,
    step_features,
)
from radixserve.sim.trace import Session, Trace, TraceError, Turn, load_mooncake
from radixserve.sim.workloads import ChatEncoder, SyntheticSpec, ThinkTime, synthetic_trace

TIMING = TimingModel(
    overhead=0.01, prefill_token=1e-4, prefill_attention=1e-8, prefill_chunk=1e-3,
    decode_request=1e-3, decode_attention=1e-7, request_overhead=0.005,
)  # fmt: skip
MOONCAKE = "tests/sim/fixtures/mooncake_sample.jsonl"


def small_trace(seed=0, sessions=40, rate=1.0):
    spec = SyntheticSpec(num_sessions=sessions, num_system_prompts=4, system_prompt_len=120,
                         mean_user_len=20, mean_output_len=12, session_rate=rate,
                         think_time=ThinkTime(3.0))  # fmt: skip
    return synthetic_trace(spec, seed)


def run(
    trace, kv=4000, instances=1, routing="cache-aware", decode_runs=True, timing=TIMING, **engine
):
    config = SimConfig(
        EngineConfig.from_options(max_total_tokens=kv, chunked_prefill_size=64, **engine),
        instances,
        RoutingConfig(routing),
        max_concurrency=4,
        check_integrity=True,
    )
    return Simulation(trace, config, timing, decode_runs=decode_runs).run()


def test_instance_runs_the_engine_scheduler_step_for_step(make_engine):
    """Same requests, same config: the simulated instance schedules exactly the steps the real
    engine runs (prefill chunks and decode batches) and gets the same cache hits."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 1000, 90).tolist()
    prompts = [shared + rng.integers(3, 1000, n).tolist() for n in (30, 70, 10, 50)]
    out_len = [6, 3, 9, 4]
    engine = make_engine(max_total_tokens=400, chunked_prefill_size=64, max_running_requests=3)
    steps_real = []
    schedule = engine.scheduler.schedule

    def recording():
        step = schedule()
        steps_real.append(([(n, r.num_computed) for r, n in step.prefills], len(step.decodes)))
        return step

    engine.scheduler.schedule = recording
    reqs = [
        engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
        for i, (p, m) in enumerate(zip(prompts, out_len, strict=True))
    ]
    while engine.has_unfinished():
        engine.step()
    sessions = [
        Session(str(i), [Turn(np.array(p, np.int32), r.token_ids[len(p) :].copy())])
        for i, (p, r) in enumerate(zip(prompts, reqs, strict=True))
    ]
    config = SimConfig(engine.config, 1, max_concurrency=4, check_integrity=True)
    sim = Simulation(Trace("t", sessions), config, TIMING, decode_runs=False)
    steps_sim = []
    inst = sim.instances[0]
    sim_schedule = inst.scheduler.schedule

    def sim_recording():
        step = sim_schedule()
        steps_sim.append(([(n, r.num_computed) for r, n in step.prefills], len(step.decodes)))
        return step

    inst.scheduler.schedule = sim_recording
    result = sim.run()
    assert [s for s in steps_sim if s != ([], 0)] == [s for s in steps_real if s != ([], 0)]
    assert result.records.cached.tolist() == [r.usage.cached_tokens for r in reqs]
    assert sum(result.records.cached) > 0  # the shared prefix was reused


def _drive(schedule, step_fn):
    steps, outputs = [], []
    while (step := schedule()) is not None:
        steps.append(([(n, r.num_computed) for r, n in step.prefills], len(step.decodes)))
        outputs += [(o.request_id, o.new_token_ids, o.finished, o.usage) for o in step_fn(step)]
    return steps, outputs


@pytest.mark.parametrize("tier", ["device", "host"])
def test_any_executor_drives_the_same_core_bookkeeping(make_engine, tier):
    """The executor interface: an executor only computes a step and draws tokens
    (``run(step) -> StepResult``); the core does the rest. A bare ``EngineCore`` driven by the
    simulator's ``TimingExecutor``, replaying the tokens the model drew, schedules the same
    steps, emits the same outputs and gets the same cache hits as the model engine; with a
    host tier, over the simulator's cache (the server's tree and tier controller over a host
    pool without KV), the same hits loaded back from the host."""
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 1000, 70).tolist()
    if tier == "device":
        prompts = [shared + rng.integers(3, 1000, n).tolist() for n in (40, 9, 60)]
        config = dict(max_total_tokens=300, chunked_prefill_size=48, max_running_requests=2)
    else:  # the second prompt evicts the first's prefix, the third finds it on the host
        prompts = [shared + rng.integers(3, 1000, 30).tolist(), rng.integers(3, 1000, 140).tolist(),
                   shared + rng.integers(3, 1000, 20).tolist()]  # fmt: skip
        config = dict(max_total_tokens=200, chunked_prefill_size=48, max_running_requests=1,
                      schedule_policy="fcfs", host_kv_memory="4MiB",
                      write_policy="write_back")  # fmt: skip
    engine = make_engine(**config)
    timing = dataclasses.replace(TIMING, kv_bytes_per_token=engine.pool.shape.bytes_per_token())
    alloc = PagedAllocator(engine.allocator.num_slots)
    cache, tiers, host = sim_cache(engine.config, alloc, None, timing)
    assert (host is None) == (tier == "device")
    core = EngineCore(engine.config, RequestKV(cache, alloc, tiers), Limits(engine.max_model_len))
    executor = TimingExecutor(timing)
    specs = [RequestSpec(request_id=str(i), prompt_ids=p,
                         params=SamplingParams(max_tokens=5 + i, ignore_eos=True))
             for i, p in enumerate(prompts)]  # fmt: skip
    for spec in specs:
        engine.add(spec)
        core.add(spec)
    model_run = _drive(
        lambda: engine.core.schedule() if engine.has_unfinished() else None,
        lambda step: engine.core.postprocess(step, engine.executor.run(step)),
    )
    tokens = {}
    for rid, new, _, _ in model_run[1]:
        tokens.setdefault(rid, []).extend(new)
    executor.outputs = {rid: np.array(t, np.int32) for rid, t in tokens.items()}
    timed_run = _drive(
        lambda: core.schedule() if core.has_unfinished() else None,
        lambda step: core.postprocess(step, executor.run(step)),
    )
    assert timed_run == model_run
    final = {rid: u for rid, _, done, u in timed_run[1] if done}
    assert sum(u.cached_tokens for u in final.values()) > 0  # reused
    if tier == "host":
        usage = final["2"]  # the shared prefix: its evicted tail loaded back from the host
        assert usage.cached_tokens == 70 and usage.host_cached_tokens > 0
        moved = engine.tiers.host.stats
        assert (host.stats.pages_to_host, host.stats.pages_to_device) == (
            moved.pages_to_host, moved.pages_to_device)  # fmt: skip
    core.check_integrity()


def test_a_host_tier_recovers_the_hits_the_device_pool_loses():
    """Same trace, same device pool: a simulated host tier serves prompt tokens the
    device-only run computes again, its copies cost the steps time, and every tier's
    integrity holds at the end."""
    trace = small_trace(sessions=40, rate=2.0)
    timing = dataclasses.replace(TIMING, host_load_token=1e-5, host_write_token=2e-5,
                                 kv_bytes_per_token=1000)  # fmt: skip
    device = run(trace, kv=1200, timing=timing)
    tiered = run(trace, kv=1200, timing=timing, host_kv_memory=40_000_000,
                 write_policy="write_back")  # fmt: skip
    assert device.config.engine.tiers.host_kv_memory is None
    hit = {name: r.records.cached.sum() / r.records.prompt_len.sum()
           for name, r in (("device", device), ("tiered", tiered))}  # fmt: skip
    assert hit["tiered"] > hit["device"] + 0.05, hit
    assert device.records.host_cached.sum() == 0 < tiered.records.host_cached.sum()
    summary = summarize(tiered)
    assert summary["host_kv_tokens_per_instance"] == 40_000
    assert summary["host_loaded_tokens"] >= summary["host_cached_tokens"] > 0
    written, loaded = summary["host_written_tokens"], summary["host_loaded_tokens"]
    assert 0 < summary["host_transfer_s"] <= timing.transfer_time(loaded, written) + 1e-9
    assert "host_kv_tokens_per_instance" not in summarize(device)


def test_a_simulated_instance_keeps_window_layers_apart_as_the_server_does():
    """Given a model geometry with sliding-window layers, the instance builds the server's
    window pool (``window_kv_share`` of the slots), tombstones window KV under pressure and
    still reuses prefixes, every request served; the KV bytes in use per cached token are the
    global layers' for each cached token plus the window layers' for the window slots in
    use, against exactly all layers' with one pool."""
    shape = KVShape(6, 1, 8, torch.float32, window_layers=(0, 1, 2, 4, 5))
    trace = small_trace(sessions=30, rate=2.0)
    results = {}
    for share in (0.0, 0.5):
        config = SimConfig(EngineConfig.from_options(max_total_tokens=1200, chunked_prefill_size=64,
                                                     window_kv_share=share),
                           max_concurrency=4, check_integrity=True, kv_shape=shape,
                           sliding_window=16)  # fmt: skip
        results[share] = Simulation(trace, config, TIMING).run()
    windowed, whole = results[0.5], results[0.0]
    allocator = windowed.instances[0].allocator
    assert isinstance(allocator, WindowedAllocator) and allocator.window_slots == 600
    assert not whole.instances[0].allocator.windowed
    w, a = summarize(windowed), summarize(whole)
    assert w["requests"] == a["requests"] == trace.num_requests and w["requests_stuck"] == 0
    assert w["window_tokens_tombstoned"] > 0 == a["window_tokens_tombstoned"]
    assert a["kv_bytes_vs_all_layers"] == 1.0
    # one global layer of six for every cached token, five window layers for at most 600
    cached = windowed.instances[0].cache.total_size()
    assert 1 / 6 < w["kv_bytes_vs_all_layers"] <= (cached + 5 * 600) / (6 * cached) < 0.75
    assert w["hit_rate"] > 0.5 * a["hit_rate"] > 0
    assert "kv_bytes_vs_all_layers" not in summarize(run(trace))


def test_turn_ends_let_sessions_over_one_document_resume_after_it():
    """A synthetic trace whose messages end with a turn-end token says so; the simulated
    caches cut paths there, so a session opening with a document another session has moved
    past resumes after the document although its window KV elsewhere was dropped: more hits
    than the same trace run by caches that do not know the token."""
    spec = SyntheticSpec(num_sessions=24, num_system_prompts=4, system_prompt_len=400,
                         zipf_exponent=0.0, mean_turns=4, mean_user_len=30, mean_output_len=40,
                         session_rate=0.5, turn_end_id=2)  # fmt: skip
    trace = synthetic_trace(spec, 0)
    assert trace.turn_end_ids == (2,)
    first = trace.sessions[0].turns
    assert first[0].prompt[399] == 2 and first[0].prompt[-1] == 2 and first[0].output[-1] == 2
    assert first[1].prompt[len(first[0].prompt) + len(first[0].output) - 1] == 2
    shape = KVShape(6, 1, 8, torch.float32, window_layers=(0, 1, 2, 4, 5))
    hits = {}
    for ends in (True, False):
        config = SimConfig(EngineConfig.from_options(max_total_tokens=4000, chunked_prefill_size=64,
                                                     window_kv_share=0.15),
                           check_integrity=True, kv_shape=shape, sliding_window=64)  # fmt: skip
        run_trace = trace if ends else dataclasses.replace(trace, turn_end_ids=())
        result = Simulation(run_trace, config, TIMING).run()
        nodes = [n for n, _ in result.instances[0].cache.nodes() if n.turn_end]
        assert bool(nodes) == ends
        hits[ends] = summarize(result)["hit_rate"]
    assert hits[True] > hits[False] + 0.02


def test_a_simulated_host_tier_needs_its_size_in_tokens():
    config = EngineConfig.from_options(max_total_tokens=1000, host_kv_memory="1MiB")
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        Simulation(small_trace(sessions=2), SimConfig(config, max_concurrency=1), TIMING)
    storage = EngineConfig.from_options(max_total_tokens=1000, kv_storage="/tmp/kv")
    with pytest.raises(ValueError, match="not kv_storage"):
        Simulation(small_trace(sessions=2), SimConfig(storage, max_concurrency=1), TIMING)


def test_decode_runs_change_nothing_but_speed():
    trace = small_trace(sessions=30)
    fast, slow = run(trace, decode_runs=True), run(trace, decode_runs=False)
    rf, rs = fast.records, slow.records
    assert np.array_equal(rf.cached, rs.cached)
    assert np.allclose(rf.first_token, rs.first_token) and np.allclose(rf.finish, rs.finish)
    assert sum(i.steps for i in fast.instances) < sum(i.steps for i in slow.instances)


def test_router_block_hashes_extend_per_session_and_equal_the_engines():
    router = SimRouter(RoutingConfig("cache-aware"), 2, 16)
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 500, 300).astype(np.int32)
    for end in (40, 100, 100, 250, 33):  # growing chat, then a shorter, different prompt
        prompt = buf[:end] if end != 33 else rng.integers(0, 500, 33).astype(np.int32)
        assert router._block_hashes(prompt, "ns", "s1") == prompt_block_hashes(prompt, 16, "ns")


def test_every_routing_policy_runs_and_cache_aware_beats_round_robin():
    trace = small_trace(sessions=60, rate=4.0)
    rates = {}
    for policy in ROUTING_POLICIES:
        result = run(trace, kv=3000, instances=4, routing=policy)
        done = ~np.isnan(result.records.finish)
        assert done.all() and result.router.policy.in_flight() == 0  # every ticket finished
        rates[policy] = result.records.cached.sum() / result.records.prompt_len.sum()
    assert rates["cache-aware"] > rates["round-robin"]
    assert rates["consistent-hash"] > rates["round-robin"]  # a session sticks to its instance


def test_lost_events_are_counted_and_delayed_events_arrive():
    trace = small_trace(sessions=20, rate=4.0)
    config = SimConfig(EngineConfig.from_options(max_total_tokens=3000), 3,
                       RoutingConfig("cache-aware", event_delay=0.5, event_loss=0.5))  # fmt: skip
    result = Simulation(trace, config, TIMING).run()
    stats = result.router.stats()
    assert stats["event_batches_lost"] > 0 and stats["event_batches_applied"] > 0


def test_mooncake_trace_shares_blocks_and_rejects_bad_lines(tmp_path):
    trace = load_mooncake(MOONCAKE)
    assert trace.timed and trace.num_requests == 8
    a, c = trace.sessions[0].turns[0].prompt, trace.sessions[2].turns[0].prompt
    assert len(a) == 1200 and np.array_equal(a[:1024], c[:1024]) and a[1024] != c[1024]
    assert [s.arrival for s in trace.sessions][:2] == [0.0, 0.35]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match="1 hash_ids for 600 tokens"):
        load_mooncake(bad)
    with pytest.raises(TraceError, match="not found"):
        load_mooncake(tmp_path / "missing.jsonl")


def test_chat_encoder_equals_encoding_the_rendered_chat(default_tokenizer):
    turns = [("What is a radix tree?", "A compressed trie."), ("And eviction?", "Leaves go first.")]
    tokens, spans = ChatEncoder(default_tokenizer).conversation("Be brief.", turns)
    messages = [{"role": "system", "content": "Be brief."}]
    for k, (user, answer) in enumerate(turns):
        messages.append({"role": "user", "content": user})
        assert tokens[: spans[k][0]].tolist() == default_tokenizer.encode_chat(messages)
        messages.append({"role": "assistant", "content": answer})
        assert default_tokenizer.decode(tokens[spans[k][1] : spans[k][2]].tolist()) == answer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_bounds_every_online_policy(seed):
    order = replay_order(small_trace(seed=seed, sessions=35))
    ceiling = replay(order, 0, "unbounded")
    pool = ceiling.tree_tokens // 4
    belady = replay(order, pool, "belady").hit_rate
    assert ceiling.hit_rate >= belady
    for policy in EVICTION_POLICIES:
        for threshold in (None, 0.2):
            assert replay(order, pool, policy, cache_threshold=threshold).hit_rate <= belady


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    true = np.array([0.004, 2e-4, 3e-8, 0.0, 1e-3, 5e-8])
    rows = [
        step_features([(int(rng.integers(1, 512)), int(rng.integers(0, 2048)))], [])
        if i % 2 else step_features([], rng.integers(10, 2000, int(rng.integers(1, 32))).tolist())
        for i in range(200)
    ]  # fmt: skip
    x = np.array(rows)
    fitted = fit_coefficients(x, x @ true)
    assert np.allclose(fitted, true, rtol=1e-6, atol=1e-12)


def test_simulate_cli_writes_results_report_and_plots(tmp_path, capsys):
    out = tmp_path / "sim"
    timing = tmp_path / "t.json"
    TIMING.save(timing)
    code = main(["simulate", "--trace", "synthetic", "--sessions", "25", "--trace-args",
                 "system_prompt_len=100,mean_user_len=20,mean_output_len=10,session_rate=2",
                 "--kv-tokens", "1500,6000", "--eviction", "lru,slru", "--timing", str(timing),
                 "--output-dir", str(out)])  # fmt: skip
    assert code == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["ok"] and line["rows"] == 4
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["kv_tokens_per_instance"], r["eviction_policy"]) for r in rows} == {
        (1500, "lru"), (1500, "slru"), (6000, "lru"), (6000, "slru")}  # fmt: skip
    assert all(0 <= r["hit_rate"] <= 1 and r["ttft_p50_s"] > 0 for r in rows)
    assert (out / "hit_rate_vs_kv_tokens.png").stat().st_size > 0
    assert "| synthetic |" in (out / "report.md").read_text()


def test_simulate_cli_takes_the_host_tier_options(tmp_path, capsys):
    out, timing = tmp_path / "sim", tmp_path / "t.json"
    dataclasses.replace(TIMING, host_load_token=1e-5, kv_bytes_per_token=1000).save(timing)
    code = main(["simulate", "--trace", "synthetic", "--sessions", "25", "--trace-args",
                 "system_prompt_len=100,mean_user_len=20,mean_output_len=10,session_rate=2",
                 "--kv-tokens", "1000", "--host-kv-memory", "none,20MB", "--write-policy",
                 "write_through", "--timing", str(timing), "--no-plots",
                 "--output-dir", str(out)])  # fmt: skip
    assert code == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    device, tiered = sorted(rows, key=lambda r: "write_policy" in r)
    assert (tiered["host_kv_tokens_per_instance"], tiered["write_policy"]) == (
        20_000, "write_through")  # fmt: skip
    assert tiered["host_written_tokens"] > 0 and tiered["hit_rate"] >= device["hit_rate"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--eviction", "mru"], "unknown --eviction 'mru'"),
        (["--routing", "best"], "unknown --routing policy 'best'"),
        (["--trace", "nope"], "--trace: unknown 'nope'"),
        (["--cache-threshold", "2"], "--cache-threshold must be in"),
        (["--router-args", "gate=1"], "unknown --router-args option"),
        (["--trace-args", "bogus=1"], "bogus"),
        (["--timing", "no-such-profile"], "neither a file nor a shipped profile"),
        (["--write-policy", "write_back"], "--write-policy needs a host tier"),
        (["--host-kv-memory", "1GiB"], "--host-kv-memory needs the timing model's kv_bytes"),
        (["--host-kv-memory", "lots"], "--host-kv-memory: cannot read 'lots'"),
    ],
)
def test_simulate_cli_rejects_bad_options(argv, message, capsys, tmp_path):
    timing = tmp_path / "t.json"  # a valid model, so each case fails on its own option only
    TIMING.save(timing)
    with pytest.raises(SystemExit):
        main(["simulate", "--sessions", "3", "--output-dir", str(tmp_path), "--timing",
              str(timing), *argv])  # fmt: skip
    assert message in capsys.readouterr().err


def test_default_timing_profile_is_shipped_and_fitted():
    model = TimingModel.load(DEFAULT_PROFILE)
    assert DEFAULT_PROFILE in shipped_profiles()
    assert model.prefill_token > 0 and model.overhead + model.decode_request > 0
    assert model.meta["model"] and model.meta["steps"] > 20  # measured, not written by hand


def test_llamacpp_slots_keep_one_sequence_each():
    a, b = np.arange(100, 160, dtype=np.int32), np.arange(500, 560, dtype=np.int32)
    out = np.arange(7, dtype=np.int32)
    sa, sb = Session("a", []), Session("b", [])
    first_a, first_b = Turn(a[:40], out), Turn(b[:40], out)
    again_a = Turn(np.concatenate([a[:40], out, a[40:50]]), out)  # turn 2 of chat a
    order = [(sa, first_a), (sb, first_b), (sa, again_a)]
    one, two = slot_replay(order, 1, 200), slot_replay(order, 2, 200)
    assert one.cached_tokens == 0  # b's chat took the only slot
    assert two.cached_tokens == 40 + 6  # a's prompt and answer (less its last token)
    assert slot_replay(order, 2, 50).failed == 1  # turn 2 does not fit a 50-token slot


def test_replay_cli_compares_designs_and_finds_memory_for_a_target(tmp_path, capsys):
    out = tmp_path / "replay"
    code = main(["simulate", "replay", "--trace", "synthetic", "--sessions", "30",
                 "--trace-args", "system_prompt_len=100,mean_user_len=20,mean_output_len=10,"
                 "session_rate=2,num_system_prompts=3", "--kv-fraction", "0.2,0.5",
                 "--eviction", "lru,belady", "--design", "tree,blocks,slots",
                 "--target-fraction", "0.9", "--output-dir", str(out)])  # fmt: skip
    assert code == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    trees = [r for r in rows if r["design"] == "tree" and r["policy"] == "lru"]
    assert len(trees) == 2 and all(0 < r["vs_belady"] <= 1 for r in trees)
    memory = {r["design"]: r for r in rows if r["policy"] == "memory for target"}
    assert set(memory) == {"tree", "blocks", "slots"}
    trace = synthetic_trace(SyntheticSpec(num_sessions=30, system_prompt_len=100,
                                          mean_user_len=20, mean_output_len=10, session_rate=2,
                                          num_system_prompts=3))  # fmt: skip
    order = replay_order(trace)
    target = memory["tree"]["target_hit_rate"]
    assert replay(order, memory["tree"]["kv_tokens"], "lru").hit_rate >= target
    assert memory["tree"]["kv_tokens"] <= memory["blocks"]["kv_tokens"]  # blocks waste tails
    assert (out / "hit_rate_vs_kv_tokens.png").exists()


def test_untimed_trace_needs_a_load_shape():
    trace = small_trace(sessions=3, rate=None)
    config = SimConfig(EngineConfig.from_options(max_total_tokens=3000))
    with pytest.raises(ValueError, match="give max_concurrency"):
        Simulation(trace, config, TIMING)


def test_time_outside_the_engine_grows_with_the_streams_in_flight():
    """Each request's TTFT carries request_overhead, request_overhead_per_token for every
    prompt token and request_overhead_per_stream for every other request in flight at its
    instance when it arrived; the engine part is unchanged."""
    trace = small_trace(sessions=16, rate=4.0)
    config = SimConfig(EngineConfig.from_options(max_total_tokens=4000, chunked_prefill_size=64), 1,
                       max_concurrency=4, check_integrity=True)  # fmt: skip
    base = Simulation(trace, config, TIMING).run().records
    busier = TimingModel(**{**TIMING.__dict__, "request_overhead_per_stream": 0.25,
                            "request_overhead_per_token": 1e-3})  # fmt: skip
    rec = Simulation(trace, config, busier).run().records
    np.testing.assert_array_equal(rec.cached, base.cached)
    np.testing.assert_array_equal(rec.first_token, base.first_token)
    assert np.all(base.outside == TIMING.request_overhead)
    streams = (rec.outside - TIMING.request_overhead - 1e-3 * rec.prompt_len) / 0.25
    # counted independently: earlier arrivals not finished when this one arrived
    counted = [
        sum(1 for j in range(i) if rec.finish[j] > rec.arrival[i]) for i in range(len(rec.arrival))
    ]
    np.testing.assert_allclose(streams, counted)
    assert max(counted) >= 2
