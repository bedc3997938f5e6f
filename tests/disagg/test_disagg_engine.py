"""Prefill/decode disaggregation at the engine level: a prefill engine and a decode engine in
one process (their KV moves over real ZeroMQ TCP sockets), driven step by step, against a
colocated engine on the same tiny model in float32.

Each scenario ends with both engines' integrity check (free + cached + held == capacity),
failures included, through the ``make_engine`` fixture.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from radixserve import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FAST_BEAT = dict(kv_transfer_heartbeat=0.1)  # a dead peer is noticed within 0.5 s


@pytest.fixture
def pair(make_engine):
    """(prefill, decode): every request the decode engine takes names the prefill engine."""
    made = []

    def make(prefill_options=None, **decode_options):
        prefill = make_engine(disaggregation_mode="prefill", **FAST_BEAT, **(prefill_options or {}))
        decode_options = {"remote_prefill_min_tokens": 1, **FAST_BEAT, **decode_options}
        decode = make_engine(disaggregation_mode="decode", **decode_options)
        made.extend([prefill, decode])
        return prefill, decode

    yield make
    for engine in made:
        engine.close()


def endpoint(prefill) -> str:
    return prefill.info().disaggregation.endpoint


def run(engine, prompts, others=(), params=GREEDY, peer=None, timeout=60.0) -> list[list[int]]:
    """Add every prompt, step ``engine`` (and ``others``) until all finish; return outputs."""
    base = f"r{time.monotonic_ns()}"
    ids = [f"{base}-{i}" for i in range(len(prompts))]
    kw = {"prefill_peer": peer} if peer else {}
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params, **kw)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done) < len(ids):
        assert time.monotonic() < deadline, "requests did not finish"
        for other in others:
            other.step()
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                assert o.finish_reason == "length", o
                done.add(o.request_id)
        time.sleep(0.0005)
    return [out[rid] for rid in ids]


def prompts(n: int, seed: int, length=(40, 120), shared: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    head = rng.integers(100, 40000, shared).tolist()
    return [head + rng.integers(100, 40000, int(rng.integers(*length))).tolist() for _ in range(n)]


def transfer(engine):
    return engine.stats().kv_transfer


def test_single_requests_match_colocated_and_move_the_prompt_but_its_last_token(make_engine, pair):
    prefill, decode = pair()
    colocated = make_engine()
    batch = prompts(2, seed=0)
    expected = run(colocated, batch)
    for p, want in zip(batch, expected, strict=True):
        before = transfer(decode).bytes
        assert run(decode, [p], [prefill], peer=endpoint(prefill)) == [want]
        moved = transfer(decode).bytes - before
        assert moved == (len(p) - 1) * decode.info().kv_bytes_per_token
    assert transfer(decode).transfers_done == 2 and transfer(prefill).transfers_done == 2
    assert transfer(prefill).bytes == transfer(decode).bytes


def test_a_chat_moves_only_each_new_turn(make_engine, pair):
    """Turn k moves the tokens after what the decode side holds (its history and its own
    answers), never the history again: bytes == uncached suffix x bytes per token. Over five
    turns that is at most 30% of what resending the history would move."""
    prefill, decode = pair()
    colocated = make_engine()
    rng = np.random.default_rng(5)
    answer = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    history: list[int] = []
    per_token = decode.info().kv_bytes_per_token
    resend = held = 0  # held: tokens whose KV the decode side has from earlier turns
    for turn in range(5):
        history += rng.integers(100, 40000, 30 + 5 * turn).tolist()
        want = run(colocated, [history], params=answer)
        before = transfer(decode).bytes
        got = run(decode, [history], [prefill], answer, peer=endpoint(prefill))
        assert got == want, f"turn {turn}"
        assert transfer(decode).bytes - before == (len(history) - 1 - held) * per_token
        resend += (len(history) - 1) * per_token
        history += got[0]
        held = len(history) - 1  # all but the answer's last token, whose KV is never computed
    assert transfer(decode).bytes <= 0.3 * resend


def test_a_concurrent_mix_with_short_prompts_computed_locally(make_engine, pair):
    prefill, decode = pair(remote_prefill_min_tokens=50)
    colocated = make_engine()
    batch = prompts(4, seed=2, length=(30, 80), shared=60) + prompts(2, seed=3, length=(5, 40))
    want = run(colocated, batch)
    assert run(decode, batch, [prefill], peer=endpoint(prefill)) == want
    stats = transfer(decode)
    # the long ones moved (those sharing the head after the first one landed move less); the
    # short ones were computed on the decode side
    assert 1 <= stats.transfers_done <= 4 and stats.transfers_failed == 0
    per_token = decode.info().kv_bytes_per_token
    assert stats.bytes < sum(len(p) - 1 for p in batch[:4]) * per_token


def test_whole_pages_with_page_size_4(make_engine, pair):
    prefill, decode = pair({"page_size": 4}, page_size=4)
    colocated = make_engine(page_size=4)
    batch = prompts(1, seed=4)
    assert run(decode, batch, [prefill], peer=endpoint(prefill)) == run(colocated, batch)
    again = [batch[0] + [7] * 30]  # the decode side's tree holds batch[0] in whole pages
    before = transfer(decode).bytes
    assert run(decode, again, [prefill], peer=endpoint(prefill)) == run(colocated, again)
    cached = len(batch[0]) // 4 * 4  # whole pages of the shared part
    moved = transfer(decode).bytes - before
    assert moved == (len(again[0]) - 1 - cached) * decode.info().kv_bytes_per_token


def test_a_dead_prefill_instance_means_computing_here(make_engine, pair):
    prefill, decode = pair()
    colocated = make_engine()
    batch = prompts(2, seed=6, length=(10, 30))
    prefill.close()  # its socket and heartbeats are gone, as when the process dies
    t0 = time.monotonic()
    assert run(decode, batch, peer=endpoint(prefill)) == run(colocated, batch)
    assert time.monotonic() - t0 < 10
    assert transfer(decode).transfers_failed == 2


def test_a_transfer_timeout_computes_here_and_the_prefill_side_lets_go(make_engine, pair):
    prefill, decode = pair(kv_transfer_timeout=0.05)
    colocated = make_engine()
    batch = prompts(1, seed=7, length=(100, 101))
    # The prefill engine is not stepped: the transfer cannot finish in time.
    assert run(decode, batch, peer=endpoint(prefill)) == run(colocated, batch)
    assert transfer(decode).failures == {"timeout": 1}
    deadline = time.monotonic() + 5
    while prefill.has_unfinished() or not transfer(prefill).transfers_failed:
        assert time.monotonic() < deadline, "the prefill side kept the cancelled request"
        prefill.step()
        time.sleep(0.01)
    assert transfer(prefill).failures == {"cancelled": 1}


def step_until(condition, engines, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        for e in engines:
            e.step()
        time.sleep(0.005)


def test_aborting_a_request_while_its_kv_is_on_its_way(make_engine, pair):
    prefill, decode = pair({"chunked_prefill_size": 16})
    [p] = prompts(1, seed=8)
    decode.add_request("x", p, GREEDY, prefill_peer=endpoint(prefill))
    decode.step()  # admitted: its slots are allocated, the transfer asked for
    assert decode.stats().num_loading == 1
    step_until(prefill.has_unfinished, [prefill])  # the prefill side is computing it
    decode.abort_request("x")
    assert decode.stats().num_loading == 0
    decode.check_integrity()
    step_until(lambda: not prefill.has_unfinished(), [prefill])  # it lets go at once
    assert prefill.stats().kv_transfer.failures == {"cancelled": 1}
    prefill.check_integrity()


def test_a_prompt_the_prefill_instance_rejects_is_computed_here(make_engine, pair):
    prefill, decode = pair({"max_model_len": 64})
    colocated = make_engine()
    batch = prompts(1, seed=9, length=(70, 90))  # longer than the prefill instance's context
    assert run(decode, batch, [prefill], peer=endpoint(prefill)) == run(colocated, batch)
    assert transfer(decode).failures == {"aborted": 1}


def test_instances_of_different_layouts_do_not_pair(make_engine, pair):
    prefill, decode = pair({"page_size": 2})
    colocated = make_engine()
    batch = prompts(1, seed=10, length=(10, 30))
    assert run(decode, batch, [prefill], peer=endpoint(prefill)) == run(colocated, batch)
    assert transfer(decode).failures == {"layout": 1}


def test_a_prefill_peer_named_to_an_instance_not_in_decode_mode_is_an_error(make_engine):
    with pytest.raises(ValueError, match="not a decode instance"):
        make_engine().add_request("x", [5, 6, 7], GREEDY, prefill_peer="tcp://127.0.0.1:1")


def test_an_engine_in_a_disaggregation_mode_needs_its_transfer_feature(tiny_loaded):
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine

    config = EngineConfig.from_options(disaggregation_mode="decode", max_total_tokens=256)
    with pytest.raises(ValueError, match="needs the KV transfer feature"):
        Engine(config, tiny_loaded)


def test_a_malformed_prefill_peer_is_an_error_and_local_means_here(make_engine, pair):
    prefill, decode = pair()
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        decode.add_request("x", [5, 6, 7], GREEDY, prefill_peer="http://nope")
    colocated = make_engine()
    batch = prompts(1, seed=11)
    assert run(decode, batch, [prefill], peer="local") == run(colocated, batch)
    assert transfer(decode).transfers_done == transfer(decode).transfers_failed == 0


def test_a_quantized_and_a_dense_instance_of_one_model_do_not_pair(
    tiny_model_dir, make_engine, pair
):
    from radixserve.model import load_model

    int8 = load_model(str(tiny_model_dir), dtype="float32", progress=False, quantization="int8")
    prefill, decode = pair({"loaded": int8})  # its KV differs from the dense model's
    assert prefill.info().disaggregation.layout != decode.info().disaggregation.layout
    batch = prompts(1, seed=12, length=(10, 30))
    assert run(decode, batch, [prefill], peer=endpoint(prefill)) == run(make_engine(), batch)
    assert transfer(decode).failures == {"layout": 1}
