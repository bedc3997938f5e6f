"""RAG segments on the tiny model: re-anchoring, partial recomputation, the segment store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import SamplingParams
from radixserve.cache import KVPool
from radixserve.engine.segment_select import kv_deviation
from radixserve.engine.segments import reanchor, segment_namespace
from radixserve.model import build_forward_batch
from radixserve.model.forward_batch import SparsePrefill

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def rag_prompt(order: list[int], docs: list[list[int]], head: list[int], question: list[int]):
    """``head + docs in order + question`` and the (start, end) range of each document."""
    prompt, segments = list(head), []
    for i in order:
        segments.append((len(prompt), len(prompt) + len(docs[i])))
        prompt += docs[i]
    return prompt + question, segments


def drive(engine, requests: list[tuple]) -> dict:
    """Run ``(request_id, prompt, kwargs)`` to the end; per request its tokens, the logprobs of
    its first token and its last output (which carries the segment counters)."""
    for rid, prompt, kwargs in requests:
        engine.add_request(rid, prompt, GREEDY, **kwargs)
    result: dict = {rid: {"tokens": [], "first": None, "last": None} for rid, _, _ in requests}
    while engine.has_unfinished():
        for out in engine.step():
            r = result[out.request_id]
            r["tokens"] += out.new_token_ids
            if r["first"] is None and out.new_logprobs:
                r["first"] = out.new_logprobs[0]
            r["last"] = out
        engine.check_integrity()
    return result


DOCS = [ids(40, 1), ids(37, 2), ids(45, 3)]
HEAD, QUESTION = ids(6, 4), ids(9, 5)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}])  # fmt: skip
def test_reanchoring_a_single_segment_is_exact(tmp_path, default_tokenizer, scaling):
    """KV computed at position 0 and rotated to position 300 gives the same K and the same
    next-token logits as computing the segment at 300 (no other context either way)."""
    from radixserve.model import load_model
    from testing.tiny_model import save_tiny_hf_model

    save_tiny_hf_model(tmp_path, rope_scaling=scaling)
    default_tokenizer.hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype="float32", progress=False).model
    pool = KVPool(model.kv_shape(), 256)
    seg, delta = torch.tensor(ids(40, 7)), 300
    m = len(seg)
    stored, moved, direct = torch.arange(0, m), torch.arange(64, 64 + m), torch.arange(128, 128 + m)
    prefill = [(seg, 0, stored, False)]
    model.forward(build_forward_batch([], prefill, model.device, pool.pad_slot), pool)
    reanchor(model, pool, stored, moved, delta)
    at_300 = SparsePrefill(seg, torch.arange(m), direct, pos_offset=delta)
    model.forward(build_forward_batch([], [at_300], model.device, pool.pad_slot), pool)
    for layer in range(len(model.layers)):
        torch.testing.assert_close(pool.k[layer][:, moved], pool.k[layer][:, direct],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
        assert torch.equal(pool.v[layer][:, moved], pool.v[layer][:, stored])
    query = torch.tensor(ids(3, 8))
    logits = []
    for ctx in (moved, direct):
        slots = torch.cat([ctx, torch.arange(200, 203)])
        item = SparsePrefill(query, torch.arange(m, m + 3), slots, delta, wants_logits=True)
        logits.append(model.forward(build_forward_batch([], [item], model.device, 0), pool))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    # moving without rotating keys is not the same: the test can tell
    pool.k[:, :, moved] = pool.k[:, :, stored]
    slots = torch.cat([moved, torch.arange(200, 203)])
    item = SparsePrefill(query, torch.arange(m, m + 3), slots, delta, wants_logits=True)
    wrong = model.forward(build_forward_batch([], [item], model.device, 0), pool)
    assert not torch.allclose(wrong, logits[1], atol=1e-3)


def stored_moved_and_direct(model, pool: KVPool) -> tuple[torch.Tensor, ...]:
    """A 40-token segment prefilled at position 0 into the pool's first slots (``stored``),
    re-anchored to position 300 into others (``moved``), and prefilled at position 300 in a
    third range (``direct``): the slots of each."""
    seg, delta = torch.tensor(ids(40, 7)), 300
    m = len(seg)
    stored, moved, direct = torch.arange(0, m), torch.arange(64, 64 + m), torch.arange(128, 128 + m)
    model.forward(build_forward_batch([], [(seg, 0, stored, False)], model.device, 0), pool)
    reanchor(model, pool, stored, moved, delta)
    at_300 = SparsePrefill(seg, torch.arange(m), direct, pos_offset=delta)
    model.forward(build_forward_batch([], [at_300], model.device, 0), pool)
    return stored, moved, direct


@pytest.mark.parametrize("ordered", [False, True])
def test_reanchoring_int8_keys_rounds_them_once(tiny_loaded, ordered):
    """In an int8 pool, rotated keys are decoded, rotated and encoded again: within a
    quantization step of the keys computed at the new position; values move bit for bit.
    With a key order, the rotation happens in the model's order (RoPE's pairs), the rows
    stay in the stored one."""
    from dataclasses import replace

    from radixserve.cache.kv_format import KeyOrder

    model = tiny_loaded.model
    shape = model.kv_shape()
    if ordered:
        perm = torch.stack([torch.randperm(shape.head_dim) for _ in range(4)])
        shape = replace(shape, key_order=KeyOrder(perm.view(2, 2, -1)))
    fmt = shape.int8_format
    pool = KVPool(shape.with_format(fmt), 256)
    stored, moved, direct = stored_moved_and_direct(model, pool)
    dim = model.kv_shape().head_dim
    for layer in range(len(model.layers)):
        got, want, unmoved = (fmt.decode(pool.k[layer][:, s], dim, torch.float32, layer)
                              for s in (moved, direct, stored))  # fmt: skip
        if layer == 0:  # the same inputs: the roundings alone (stored, rotated, re-encoded)
            step = want.abs().amax(-1, keepdim=True) / 127
            assert ((got - want).abs() <= 2.5 * step + 1e-6).all()
        # later layers' inputs differ by the rounding of the layers before
        assert (got - want).norm() < 0.03 * want.norm()
        assert (unmoved - want).norm() > 0.3 * want.norm()  # not rotating: far off
        assert torch.equal(pool.v[layer][:, moved], pool.v[layer][:, stored])


def test_reanchoring_rotates_the_float_layers_of_an_int8_pool(tiny_loaded):
    """An int8 pool keeping layer 0 in float32: that layer's keys are rotated as a float
    pool's are (the keys computed at the new position), its values move bit for bit."""
    from radixserve.cache.kv_format import KVFormat

    model = tiny_loaded.model
    pool = KVPool(model.kv_shape().with_format(KVFormat.of("int8"), (0,)), 256)
    stored, moved, direct = stored_moved_and_direct(model, pool)
    torch.testing.assert_close(pool.fk[0][:, moved], pool.fk[0][:, direct], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(pool.fk[0][:, stored], pool.fk[0][:, direct], atol=1e-2)
    assert torch.equal(pool.fv[0][:, moved], pool.fv[0][:, stored])


def test_sparse_rows_over_exact_kv_give_the_plain_prefill(tiny_loaded):
    """Rows spread through a 300-token context (several attention groups, each cut at its
    last row) computed over exact K/V of the other rows: the same K/V and logits as a plain
    prefill of the whole context. A group that saw too little context, or a row that saw
    past itself, would change them."""
    from radixserve.model.forward_batch import SPARSE_GROUP

    model = tiny_loaded.model
    pool = KVPool(model.kv_shape(), 1024)
    tokens, n = torch.tensor(ids(300, 11)), 300
    plain, sparse = torch.arange(0, n), torch.arange(400, 400 + n)
    batch = build_forward_batch([], [(tokens, 0, plain, True)], model.device, pool.pad_slot)
    want = model.forward(batch, pool)
    rows = torch.tensor(sorted({*range(0, n, 3), *range(250, n)}))
    assert len(rows) > 2 * SPARSE_GROUP
    pool.k[:, :, sparse] = pool.k[:, :, plain]  # exact K/V everywhere ...
    pool.v[:, :, sparse] = pool.v[:, :, plain]
    pool.k[:, :, sparse[rows]] = 0.0  # ... but the rows, which the sparse pass must compute
    pool.v[:, :, sparse[rows]] = 0.0
    item = SparsePrefill(tokens[rows], rows, sparse, wants_logits=True)
    got = model.forward(build_forward_batch([], [item], model.device, pool.pad_slot), pool)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool.k[:, :, sparse], pool.k[:, :, plain], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pool.v[:, :, sparse], pool.v[:, :, plain], atol=1e-5, rtol=1e-4)


def test_ratio_one_equals_plain_prefill(make_engine):
    prompt, segments = rag_prompt([2, 0, 1], DOCS, HEAD, QUESTION)
    warm, warm_segments = rag_prompt([1, 2, 0], DOCS, ids(11, 9), QUESTION)
    plain = drive(make_engine(), [("p", prompt, {})])["p"]
    engine = make_engine()
    drive(engine, [("w", warm, {"segments": warm_segments})])
    blended = drive(engine, [("b", prompt, {"segments": segments, "recompute_ratio": 1.0})])["b"]
    out = blended["last"]
    assert out.usage.segment_hits == 3 and out.usage.reused_tokens == 0
    assert out.usage.recomputed_tokens == sum(e - s for s, e in segments)
    assert blended["tokens"] == plain["tokens"]
    assert blended["first"].token_id == plain["first"].token_id
    assert blended["first"].logprob == pytest.approx(plain["first"].logprob, abs=1e-4)
    for (t1, lp1), (t2, lp2) in zip(blended["first"].top, plain["first"].top, strict=True):
        assert t1 == t2 and lp1 == pytest.approx(lp2, abs=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_partial_reuse_counts_and_keeps_the_prefix_tree_exact(make_engine, kv_cache_dtype):
    prompt, segments = rag_prompt([0, 1, 2], DOCS, HEAD, QUESTION)
    engine = make_engine(kv_cache_dtype=kv_cache_dtype)
    first = drive(engine, [("a", prompt, {"segments": segments, "recompute_ratio": 0.25})])["a"]
    out = first["last"]
    total = sum(e - s for s, e in segments)
    assert out.usage.segment_hits == 0 and engine.segments.stats.fills == 3  # stored on first sight
    assert out.usage.recomputed_tokens == int(np.ceil(0.25 * total))
    assert out.usage.reused_tokens + out.usage.recomputed_tokens == total
    assert len(first["tokens"]) == GREEDY.max_tokens
    # only the exact part before the first reused token entered the prefix tree
    assert engine.cache.peek_prefix(prompt).length == segments[0][0]
    # the segments are stored in their own namespace, keyed by content, from position 0
    for s, e in segments:
        assert engine.cache.peek_prefix(prompt[s:e], segment_namespace(None)).length == e - s
    assert engine.cache.peek_prefix(DOCS[0]).length == 0
    again = drive(engine, [("b", prompt, {"segments": segments, "recompute_ratio": 0.0})])["b"]
    assert again["last"].usage.segment_hits == 3 and again["last"].usage.recomputed_tokens == 0
    assert again["last"].usage.cached_tokens == segments[0][0]
    stats = engine.stats().segments
    assert (stats.lookups, stats.hits, stats.fills) == (6, 3, 3)


def test_segments_respect_namespaces(make_engine):
    prompt, segments = rag_prompt([0, 1], DOCS, HEAD, QUESTION)
    engine = make_engine()
    drive(engine, [("a", prompt, {"segments": segments, "namespace": "tenant-a"})])
    other = drive(engine, [("b", prompt, {"segments": segments, "namespace": "tenant-b"})])["b"]
    assert other["last"].usage.segment_hits == 0 and other["last"].usage.cached_tokens == 0
    same = drive(engine, [("c", prompt, {"segments": segments, "namespace": "tenant-a"})])["c"]
    assert same["last"].usage.segment_hits == 2


def test_segments_are_locked_while_used_and_evicted_like_the_tree(make_engine):
    """A pool too small for every segment: storing new ones evicts old unlocked ones, never
    one a running request reads, and nothing leaks (integrity after every step)."""
    docs = [ids(60, 20 + i) for i in range(8)]
    engine = make_engine(max_total_tokens=448)
    for round_ in range(2):
        reqs = []
        for i in range(4):
            order = [(i + round_) % 8, (i + 3) % 8]
            prompt, segments = rag_prompt(order, docs, ids(5, 40 + i), QUESTION)
            reqs.append((f"r{round_}-{i}", prompt, {"segments": segments}))
        result = drive(engine, reqs)
        assert all(len(r["tokens"]) == GREEDY.max_tokens for r in result.values())
    assert engine.cache.stats.evictions > 0
    assert engine.cache.protected_size() == 0  # every lock dropped
    engine.flush_cache()
    assert engine.allocator.free_size() == engine.allocator.num_slots


def test_bad_segments_are_clear_errors(make_engine):
    engine = make_engine()
    prompt = ids(30, 1)
    for bad in ([(5, 3)], [(0, 10), (5, 12)], [(0, 31)], [(-1, 4)], [("a", 3)], [(1, 2, 3)]):
        with pytest.raises(ValueError, match="segment"):
            engine.add_request("x", prompt, GREEDY, segments=bad)
    for ratio in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="recompute ratio"):
            engine.add_request("x", prompt, GREEDY, segments=[(0, 10)], recompute_ratio=ratio)
    assert not engine.has_unfinished()
    from radixserve.config import EngineConfig

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="segment_prefix_tokens"):
            EngineConfig.from_options(segment_prefix_tokens=bad)


def test_recompute_selection_picks_the_budget_from_the_reused_tokens(make_engine):
    """The selection picks exactly the budget, only reused tokens, each segment's first tokens
    first."""
    prompt, segments = rag_prompt([2, 0, 1], DOCS, HEAD, QUESTION)
    engine = make_engine()
    drive(engine, [("w", prompt, {"segments": segments})])
    select = engine.segments.select
    picks = []
    pick = select.pick
    select.pick = lambda *a: picks.append(pick(*a)) or picks[-1]  # a spy on the selection
    drive(engine, [("b", prompt, {"segments": segments, "recompute_ratio": 0.3})])
    total = sum(e - s for s, e in segments)
    got = picks[0].tolist()
    assert len(got) == len(set(got)) == int(np.ceil(0.3 * total))
    per_segment = [[i for i in got if s <= i < e] for s, e in segments]
    assert sum(map(len, per_segment)) == len(got)  # nothing outside the reused segments
    for (s, _), mine in zip(segments, per_segment, strict=True):
        assert set(range(s, s + select.first_tokens)) <= set(mine)


def test_probe_attention_column_is_a_distribution_per_query_row(tiny_loaded):
    """The probe's attention column sums, over the rows, to (query rows x heads): each of the
    last rows' softmax over the rows it may see, causal."""
    model = tiny_loaded.model
    pool = KVPool(model.kv_shape(), 256)
    tokens, slots = torch.tensor(ids(50, 12)), torch.arange(50)
    batch = build_forward_batch([], [(tokens, 0, slots, False)], model.device, pool.pad_slot)
    model.forward(batch, pool)
    dev = kv_deviation(model, batch, pool, 1, query_rows=7)[0]
    assert dev.shape == (50, 3)
    assert float(dev[:, 2].sum()) == pytest.approx(7 * model.config.num_heads, rel=1e-4)
    assert torch.allclose(dev[:, :2], torch.zeros(50, 2), atol=1e-4)  # exact K/V: no deviation
    # causal: the last row is seen by itself only, whatever the number of query rows
    alone = kv_deviation(model, batch, pool, 1, query_rows=1)[0]
    assert float(alone[:, 2].sum()) == pytest.approx(model.config.num_heads, rel=1e-4)
    assert float(dev[49, 2]) == pytest.approx(float(alone[49, 2]), rel=1e-4)


@pytest.fixture(scope="module")
def deep_loaded(tmp_path_factory, default_tokenizer):
    """A tiny random Llama with four layers (the default one has two): room for probes."""
    from radixserve.model import load_model
    from testing.tiny_model import save_tiny_hf_model

    path = tmp_path_factory.mktemp("tiny-llama-4")
    save_tiny_hf_model(path, num_hidden_layers=4)
    default_tokenizer.hf.save_pretrained(path)
    return load_model(str(path), dtype="float32", progress=False)


def test_probe_over_several_layers_scores_each_against_the_pool(deep_loaded):
    """A probe from layer 1 to 3 scores each layer against what the pool held before the
    call: V perturbed at layer 2 for five rows shows there only (as V, not K); layer 1 and
    layer 3 (whose inputs the probe recomputed exactly) show none; each layer's attention
    column is a distribution per query row."""
    model = deep_loaded.model
    pool = KVPool(model.kv_shape(), 256)
    tokens, slots = torch.tensor(ids(50, 12)), torch.arange(50)
    batch = build_forward_batch([], [(tokens, 0, slots, False)], model.device, pool.pad_slot)
    model.forward(batch, pool)
    pool.v[2][:, 10:15] += 0.5
    dev = kv_deviation(model, batch, pool, 3, query_rows=7, first=1)
    assert dev.shape == (3, 50, 3)
    moved = torch.zeros(50, dtype=torch.bool)
    moved[10:15] = True
    assert bool((dev[1, moved, 1] > 0.1).all()) and float(dev[1, ~moved, 1].abs().max()) < 1e-4
    assert float(dev[1, :, 0].abs().max()) < 1e-4  # K untouched
    assert float(dev[[0, 2], :, :2].abs().max()) < 1e-4
    sums = dev[:, :, 2].sum(dim=1)
    assert torch.allclose(sums, torch.full((3,), 7.0 * model.config.num_heads), rtol=1e-4)


def test_segments_stored_after_the_prompt_prefix(make_engine):
    """With ``segment_prefix_tokens`` a segment is stored as the prompt's first tokens plus the
    segment, so every segment stored after one prefix shares it in the tree; a segment that
    sits right after that prefix is then reused exactly (ratio 0 gives the plain prefill), and
    ratio 1.0 still equals the plain prefill for segments moved elsewhere."""
    head = HEAD + ids(4, 13)
    prompt, segments = rag_prompt([0, 1, 2], DOCS, head, QUESTION)
    engine = make_engine(segment_prefix_tokens=6)
    ns = segment_namespace(None)
    got = drive(engine, [("a", prompt, {"segments": segments, "recompute_ratio": 0.0})])["a"]
    assert engine.segments.stats.fills == 3 and got["last"].usage.recomputed_tokens == 0
    for s, e in segments:  # keyed by the prefix + the segment, not the segment alone
        assert engine.cache.peek_prefix(HEAD + prompt[s:e], ns).length == 6 + e - s
        assert engine.cache.peek_prefix(prompt[s:e], ns).length == 0
    # the three share one stored prefix: 6 prefix tokens + the segments, nothing more
    assert engine.cache.total_size() == segments[0][0] + 6 + sum(e - s for s, e in segments)
    # a prompt holding one segment right after the prefix: its stored K/V is exact
    alone = head[:6] + DOCS[1] + QUESTION
    want = drive(make_engine(), [("q", alone, {})])["q"]
    one = drive(engine, [("o", alone, {"segments": [(6, 6 + len(DOCS[1]))],
                                        "recompute_ratio": 0.0})])["o"]  # fmt: skip
    assert one["last"].usage.segment_hits == 1 and one["last"].usage.recomputed_tokens == 0
    assert one["tokens"] == want["tokens"]
    assert one["first"].logprob == pytest.approx(want["first"].logprob, abs=1e-4)
    # moved (after another prompt's head): approximate at ratio 0, a plain prefill at 1.0
    other, other_segments = rag_prompt([2, 0, 1], DOCS, HEAD + ids(9, 14), QUESTION)
    ref = drive(make_engine(), [("r", other, {})])["r"]
    full = drive(engine, [("f", other, {"segments": other_segments, "recompute_ratio": 1.0})])
    assert full["f"]["last"].usage.segment_hits == 3
    assert full["f"]["tokens"] == ref["tokens"]
    assert full["f"]["first"].logprob == pytest.approx(ref["first"].logprob, abs=1e-4)
