"""Sampling parameters through the whole engine (tiny model), and the offline chat API."""

from __future__ import annotations

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.engine.request import Request
from radixserve.engine.sampler import sample
from radixserve.engine.spec import RequestSpec

PROMPT = [523, 9012, 77, 310, 4511, 98, 1200, 33, 871, 15000]


@pytest.fixture
def llm(make_engine):
    return LLM.from_engine(make_engine())


def gen(llm, **params):
    return llm.generate([PROMPT], SamplingParams(**params))[0]


def test_greedy_is_deterministic_and_top_k_1_is_greedy(llm):
    a = gen(llm, temperature=0, max_tokens=12, ignore_eos=True)
    b = gen(llm, temperature=0, max_tokens=12, ignore_eos=True)
    c = gen(llm, temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True)
    assert a.token_ids == b.token_ids == c.token_ids


def test_seed_reproduces_and_differs_between_seeds(llm):
    runs = [
        gen(llm, temperature=1.0, seed=s, max_tokens=16, ignore_eos=True).token_ids
        for s in (5, 5, 6)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_seeded_request_is_independent_of_its_batch(llm):
    p = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPT], p)[0].token_ids
    batched = llm.generate([PROMPT[:4], PROMPT, PROMPT[2:]], [p, p, p])
    assert batched[1].token_ids == alone


def test_top_p_and_min_p_restrict_to_likely_tokens(llm):
    greedy = gen(llm, temperature=0, max_tokens=1).token_ids
    for s in range(5):  # a tiny nucleus or a min-p of 1 leaves only the most likely token
        assert gen(llm, temperature=1.0, top_p=1e-6, seed=s, max_tokens=1).token_ids == greedy
        assert gen(llm, temperature=1.0, min_p=1.0, seed=s, max_tokens=1).token_ids == greedy


def test_max_tokens_and_stop_token_ids(llm):
    out = gen(llm, temperature=0, max_tokens=7, ignore_eos=True)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    stop_at = out.token_ids[3]
    stopped = gen(llm, temperature=0, max_tokens=7, ignore_eos=True, stop_token_ids=[stop_at])
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"


def test_stop_strings_cut_the_text(llm):
    full = gen(llm, temperature=0, max_tokens=20, ignore_eos=True)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert len(stop) == 3
    cut = gen(llm, temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    kept = gen(
        llm,
        temperature=0,
        max_tokens=20,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert kept.text == full.text[: full.text.index(stop) + 3]
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished()


def _request_with_history(params: SamplingParams, prompt: list[int], output: list[int]):
    req = Request(
        RequestSpec(request_id="r", prompt_ids=prompt, params=params), max_tokens=10, seed=0
    )
    for t in output:
        req.append_token(t)
    return req


@pytest.mark.parametrize(
    "params",
    [
        dict(frequency_penalty=0.6),  # 10 - 2 * 0.6 = 8.8 < 9
        dict(presence_penalty=1.5),  # 10 - 1.5 = 8.5 < 9
        dict(repetition_penalty=1.2),  # 10 / 1.2 = 8.3 < 9 (token 5 is in the prompt)
    ],
)
def test_penalties_push_a_repeated_token_below_a_fresh_one(params):
    logits = torch.full((1, 16), -5.0)
    logits[0, 5], logits[0, 7] = 10.0, 9.0
    plain = _request_with_history(SamplingParams(temperature=0), [5, 1], [5, 5])
    penalised = _request_with_history(SamplingParams(temperature=0, **params), [5, 1], [5, 5])
    assert sample(logits, [plain])[0][0] == 5
    assert sample(logits, [penalised])[0][0] == 7
    assert logits[0, 5] == 10.0  # the caller's logits are left alone


def test_repetition_penalty_applies_once_to_each_seen_token_and_to_no_other():
    from radixserve.engine.sampler import _apply_penalties

    torch.manual_seed(0)
    logits = torch.randn(1, 64) * 3
    params = SamplingParams(temperature=0, repetition_penalty=1.3)
    req = _request_with_history(params, [3, 3, 9, 40], [9, 50, 3])
    expected = logits[0].clone()
    for t in (3, 9, 40, 50):  # positive logits divided, negative ones multiplied, once
        expected[t] = expected[t] / 1.3 if expected[t] > 0 else expected[t] * 1.3
    _apply_penalties(logits, [req], [0])
    assert torch.equal(logits[0], expected)


def test_frequency_penalty_scales_with_count_presence_does_not():
    logits = torch.zeros((2, 8))
    logits[:, 3], logits[:, 4] = 2.0, 1.0
    once = _request_with_history(SamplingParams(temperature=0, frequency_penalty=0.6), [0], [3])
    twice = _request_with_history(SamplingParams(temperature=0, frequency_penalty=0.6), [0], [3, 3])
    assert [t for t, _ in sample(logits, [once, twice])] == [3, 4]  # 2 - 0.6 > 1 > 2 - 1.2


def test_logprobs_of_chosen_and_top_tokens(llm):
    out = gen(llm, temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the chosen token is the top
        assert lp.top[0][1] == pytest.approx(lp.logprob)


def test_generate_accepts_strings_and_token_lists(llm):
    outs = llm.generate(["Hello there", PROMPT], SamplingParams(temperature=0, max_tokens=3))
    assert outs[0].prompt == "Hello there"
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("Hello there")
    assert outs[1].prompt_token_ids == PROMPT and outs[1].prompt is None
    with pytest.raises(ValueError, match="string or a non-empty list"):
        llm.generate([[]])


def test_chat_renders_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2))[0]
    assert out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("assistant\n")
    assert len(out.token_ids) <= 2
