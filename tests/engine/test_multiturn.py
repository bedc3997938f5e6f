"""Multi-turn chat on the real default model: each turn reuses the previous one's KV."""

from __future__ import annotations

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine import Engine

QUESTIONS = ["What is the capital of France?", "And of Germany?", "Which of the two is bigger?"]
PARAMS = SamplingParams(temperature=0, max_tokens=24)


def chat_turns(llm: LLM):
    history, results = [], []
    for q in QUESTIONS:
        history.append({"role": "user", "content": q})
        out = llm.chat(history, PARAMS)[0]
        results.append(out)
        history.append({"role": "assistant", "content": out.text})
    return results


def make_llm(real_loaded, **options) -> LLM:
    config = EngineConfig.from_options(load_progress=False, max_total_tokens=8192, **options)
    return LLM.from_engine(Engine(config, real_loaded))


def test_each_turn_hits_the_previous_prompt_and_answer(real_loaded):
    llm = make_llm(real_loaded)
    turns = chat_turns(llm)
    assert turns[0].cached_tokens == 0
    for before, after in zip(turns, turns[1:], strict=False):
        answered = len(before.prompt_token_ids) + len(before.token_ids)
        # everything but the last token, whose KV is never computed (page_size 1)
        assert after.cached_tokens >= answered - 1, (after.cached_tokens, answered)
    llm.engine.check_integrity()


def test_answers_are_the_same_without_the_cache(real_loaded):
    on = chat_turns(make_llm(real_loaded))
    off = chat_turns(make_llm(real_loaded, enable_prefix_caching=False))
    assert [t.token_ids for t in on] == [t.token_ids for t in off]
    assert all(t.cached_tokens == 0 for t in off)
    assert "Paris" in on[0].text
