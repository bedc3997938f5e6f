"""Sliding-window layers kept apart, end to end on a tiny random Gemma 3 (5 local layers of 7).

Multi-turn conversations (each turn's prompt is the last prompt, its answer and new tokens),
each with a branch off its middle per turn, run on two engines over the same weights: one
keeping every layer's KV in one pool, one with the window layers' KV in a pool of a quarter
of the slots, so that window KV is tombstoned all the time. Greedy outputs must be the same
token for token, through the native decoder and through PyTorch only, at page sizes 1 and
16, and with a host tier below; the split engine must really have dropped window KV and
still reused prefixes, and pass ``check_integrity`` after every turn.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from conftest import save_tiny_hf_model

from radixserve import SamplingParams

WINDOW = 24
GEMMA = dict(
    num_hidden_layers=7,  # local 0-4, global 5, local 6
    head_dim=32,
    query_pre_attn_scalar=32,
    sliding_window=WINDOW,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    },
    rms_norm_eps=1e-6,
    pad_token_id=0,
)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_loaded(tmp_path_factory, default_tokenizer):
    from radixserve.model import load_model

    path = tmp_path_factory.mktemp("tiny-gemma3")
    save_tiny_hf_model(path, "Gemma3TextConfig", seed=3, **GEMMA)
    default_tokenizer.hf.save_pretrained(path)
    return load_model(str(path), dtype="float32", progress=False)


def conversations(engine, turns: int = 5, convs: int = 4, first: int = 30,
                  more: int = 14) -> list[list[int]]:  # fmt: skip
    """Each conversation's outputs and its branch's, turn by turn (interleaved). User
    messages end with the model's end-of-turn token, as a chat template ends them."""
    rng = np.random.default_rng(5)
    end = engine.tokenizer.eos_token_ids[:1]
    prompts = [rng.integers(100, 40000, first).tolist() + end for _ in range(convs)]
    outputs: list[list[int]] = []
    for turn in range(turns):
        for c in range(convs):
            engine.add_request(f"{c}-{turn}", prompts[c], GREEDY)
            # and a branch off the middle of the conversation: its match ends where the
            # window KV before it may be gone
            middle = prompts[c][: len(prompts[c]) * 2 // 3]
            engine.add_request(f"{c}-{turn}-branch", middle + [7 + turn], GREEDY)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
        for c in range(convs):
            answer = done[f"{c}-{turn}"]
            outputs += [answer, done[f"{c}-{turn}-branch"]]
            prompts[c] = prompts[c] + answer + rng.integers(100, 40000, more).tolist() + end
    return outputs


@pytest.mark.parametrize("page_size", [1, 16])
def test_tombstoned_window_kv_gives_the_same_output(make_engine, gemma_loaded, page_size, kernels):
    whole = make_engine(gemma_loaded, max_total_tokens=1024, page_size=page_size,
                        window_kv_share=0)  # fmt: skip
    split = make_engine(gemma_loaded, max_total_tokens=1024, page_size=page_size,
                        window_kv_share=0.25)  # fmt: skip
    assert not whole.pool.windowed and split.pool.windowed
    assert split.pool.wk.shape[0] == 6 and split.pool.k.shape[0] == 1
    assert conversations(split) == conversations(whole)
    assert any(node.turn_end for node, _ in split.cache.nodes())  # paths cut at turn ends
    assert split.stats().window.tombstoned_tokens > 0  # window KV was dropped ...
    stats = split.cache.stats
    assert stats.hit_tokens > 0.3 * stats.lookup_tokens  # ... and prefixes still reused
    assert split.pool.nbytes() < 0.5 * whole.pool.nbytes()


@pytest.mark.parametrize("write_policy, share", [("write_back", 1.0), ("write_through", 0.5)])
def test_the_host_tier_keeps_tombstones_and_windows_apart(make_engine, gemma_loaded,
                                                          write_policy, share):  # fmt: skip
    """With a host tier under a small device pool, nodes go to the host with or without
    their window KV and come back as they went (a match never resumes where a copy without
    it would be read, on the device or after a partial load): the output is still
    every-layer's. (With write_back and a small window pool, a node is usually a tombstone by
    the time it is evicted, and its copy without window KV is rarely of use: see below.)"""
    tiers = dict(max_total_tokens=256, page_size=16, host_kv_memory=64 << 20,
                 write_policy=write_policy)  # fmt: skip
    whole = make_engine(gemma_loaded, window_kv_share=0, **tiers)
    split = make_engine(gemma_loaded, window_kv_share=share, **tiers)
    assert split.pool.windowed and not whole.pool.windowed
    assert conversations(split) == conversations(whole)
    stats = split.stats()
    assert stats.window.tombstoned_tokens > 0 and stats.cache.host_hit_tokens > 0
    assert stats.cache.hit_tokens > 0.5 * whole.stats().cache.hit_tokens


def test_a_window_pool_smaller_than_a_prompt_and_its_window_serves_every_turn(
    make_engine, gemma_loaded
):
    """A 64-slot window pool (a quarter of the device pool, 4 pages) under prompts of up to
    100 tokens and a 24-token window: a prompt's chunks are cut to what the window pool holds
    beside the window its match keeps locked, so every request is served (none waits
    forever), with every-layer's output."""
    tiers = dict(max_total_tokens=256, page_size=16, host_kv_memory=64 << 20,
                 write_policy="write_back")  # fmt: skip
    whole = make_engine(gemma_loaded, window_kv_share=0, **tiers)
    split = make_engine(gemma_loaded, window_kv_share=0.25, **tiers)
    assert split.stats().window.capacity_tokens == 64
    assert conversations(split) == conversations(whole)
    assert split.stats().window.tombstoned_tokens > 0 and split.stats().cache.hit_tokens > 0


@pytest.mark.parametrize("share", [0, 0.2])
def test_rag_segments_are_refused_for_sliding_window_models(make_engine, gemma_loaded, share):
    engine = make_engine(gemma_loaded, max_total_tokens=256, window_kv_share=share)
    with pytest.raises(ValueError, match="sliding-window layers"):
        engine.add_request("r", list(range(100, 140)), GREEDY, segments=((0, 20),))


@pytest.mark.slow
def test_real_gemma3_270m_conversations_same_output_with_the_window_pool(
    make_engine, float_activations
):
    """The released Gemma 3 270M Q4_K_M (window 512): conversations growing past the window
    in a pool whose window part holds a fifth of the slots give the greedy output of keeping
    every layer's KV (in float32 with float activations: in bfloat16, or with prompt rows
    rounded to int8, KV computed in a prefill chunk and in a decode step differ in rounding,
    so recomputing a dropped window may flip a near tie), while window KV is dropped and
    prefixes are reused."""
    from radixserve.model import load_model
    from radixserve.model.registry import KNOWN_MODELS, installed_path

    path = installed_path(KNOWN_MODELS["gemma3-270m"])
    if path is None:
        pytest.skip("gemma3-270m is not installed (`radixserve pull gemma3-270m`)")
    loaded = load_model(path, dtype="float32", progress=False)
    outs, hits = {}, {}
    for share in (0, 0.2):
        engine = make_engine(loaded, max_total_tokens=6144, page_size=16,
                             window_kv_share=share, chunked_prefill_size=512)  # fmt: skip
        outs[share] = conversations(engine, turns=4, convs=3, first=420, more=160)
        hits[share] = engine.cache.stats.hit_tokens
        if share:
            window = engine.stats().window
            assert window.tombstoned_tokens > 0 and window.capacity_tokens < 1300
    assert outs[0.2] == outs[0]
    assert hits[0.2] > 0.5 * hits[0]  # in a third of the memory (the branches lose most)


@pytest.mark.parametrize("chunk", [32, None], ids=["chunks-of-32", "default-chunks"])
def test_a_prompt_longer_than_the_window_pool_is_admitted_and_served(make_engine, gemma_loaded,
                                                                     chunk):  # fmt: skip
    """A window pool of 80 slots serves a 300-token prompt: computed chunk by chunk, each
    chunk's window KV can be dropped once it is in the tree, so the request needs room for a
    chunk and the window before it, not for its whole prompt. Chunks are cut to the window
    room when the configured chunk is larger (the default); the answers are those of an
    engine keeping every layer's KV."""
    options = {} if chunk is None else {"chunked_prefill_size": chunk}
    answers = []
    for share in (0.2, 0):
        engine = make_engine(gemma_loaded, max_total_tokens=400, window_kv_share=share,
                             **options)  # fmt: skip
        engine.add_request("long", list(range(1000, 1300)), GREEDY)
        engine.add_request("short", list(range(2000, 2020)), GREEDY)
        done: dict[str, list[int]] = {}
        for _ in range(200):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert {k: len(v) for k, v in done.items()} == {"long": 6, "short": 6}
        answers.append(done)
        if share:
            assert engine.stats().window.capacity_tokens == 80
            assert engine.stats().window.tombstoned_tokens > 0
    assert answers[0] == answers[1]


# ---------------------------------------------------------------------- the storage tier
STORED = dict(max_total_tokens=256, page_size=16, host_kv_memory="1MiB",
              kv_storage_block_tokens=16, storage_prefetch_min_tokens=16,
              load_back_min_tokens=16, storage_prefetch_timeout=30)  # fmt: skip
TURNS = dict(turns=3, convs=4)


@pytest.fixture(scope="module")
def uncached(gemma_loaded):
    """What the model answers to the conversations with no cache at all."""
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine

    config = EngineConfig.from_options(load_progress=False, enable_prefix_caching=False,
                                       max_total_tokens=1024)  # fmt: skip
    return conversations(Engine(config, gemma_loaded), **TURNS)


def test_a_storage_tier_keeps_the_window_layers_apart(make_engine, gemma_loaded, tmp_path):
    from radixserve.engine.cache_setup import window_share

    engine = make_engine(gemma_loaded, kv_storage=str(tmp_path), window_kv_share=0.25, **STORED)
    assert window_share(engine.config, engine.pool.shape) == 0.25
    assert engine.pool.windowed and engine.pool.k.shape[0] == 1  # the global layer only
    assert engine.tiers.storage.backend.layout.window_layers == (0, 1, 2, 3, 4, 6)
    engine.close()


def stored_blocks(engine) -> tuple[int, int]:
    """Blocks in the engine's file store: with window KV, and without (a tombstone's)."""
    backend = engine.tiers.storage.backend
    sizes = [p.stat().st_size for p in backend.dir.rglob("*.kv")]
    full = sum(size == backend.layout.record_nbytes for size in sizes)
    return full, len(sizes) - full


@pytest.mark.parametrize(
    "store, write_policy, share",
    [("file", "write_through", 0.5), ("file", "write_back", 0.75), ("redis", "write_through", 0.5)],
)
def test_a_restarted_engine_answers_from_storage_with_the_uncached_output(
    make_engine, gemma_loaded, uncached, tmp_path, monkeypatch, store, write_policy, share
):
    """Multi-turn conversations on an engine whose device pool (256 tokens) and host tier
    (just larger) keep little, over a store; then on a fresh engine over the same store (a
    restart), which fetches their turns from it: as blocks with window KV and (write_back:
    a node is often a tombstone by the time it is evicted and copied) without it. Both give
    the uncached model's output, and ``check_integrity`` passes after every turn."""
    from testing.redis_server import RedisServer

    with contextlib.ExitStack() as stack:
        url = str(tmp_path)
        if store == "redis":
            url = stack.enter_context(RedisServer()).url
        options = dict(kv_storage=url, window_kv_share=share, write_policy=write_policy)
        first = make_engine(gemma_loaded, **options, **STORED)
        assert first.pool.windowed
        assert conversations(first, **TURNS) == uncached
        first.close()  # drains the write-outs
        second = make_engine(gemma_loaded, **options, **STORED)
        attached = np.zeros(2, dtype=int)  # tokens hung from storage: with window KV, without
        attach = second.cache.attach_host

        def spy(tokens, namespace, start, slots, window):
            attached[:] += (int(window.sum()), int((~window).sum()))
            return attach(tokens, namespace, start, slots, window)

        monkeypatch.setattr(second.cache, "attach_host", spy)
        assert conversations(second, **TURNS) == uncached
        stats = second.stats()
        assert stats.cache.storage_hit_tokens > 0 and stats.window.tombstoned_tokens > 0
        assert attached[0] > 0
        if write_policy == "write_back":  # tombstones' copies were stored and came back
            assert stored_blocks(second)[1] > 0 and attached[1] > 0
        second.close()
        second.check_integrity()
