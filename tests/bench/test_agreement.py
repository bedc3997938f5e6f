"""Greedy agreement between two servers: where answers part, and whether it was a near tie."""

from __future__ import annotations

from radixserve.bench.agreement import NEAR_TIE, compare, penalty_off


def answer(tokens: list[str], margins: list[float], prompt_tokens: int = 30) -> dict:
    content = [
        {"token": t, "top_logprobs": [{"token": t, "logprob": -0.1}, {"logprob": -0.1 - m}]}
        for t, m in zip(tokens, margins, strict=True)
    ]
    return {
        "choices": [{"message": {"content": "".join(tokens)}, "logprobs": {"content": content}}],
        "usage": {"prompt_tokens": prompt_tokens},
    }


def test_equal_answers_agree():
    same = answer(["a", "b"], [2.0, 2.0])
    result = compare("q", {"radix": same, "llamacpp": same}, "radix")
    assert result.agree and result.verdict == "same" and result.first_difference is None


def test_a_difference_is_placed_and_classed_by_the_references_margin():
    ours = answer(["a", "b", "c"], [2.0, NEAR_TIE / 2, 2.0])
    peer = answer(["a", "x", "c"], [2.0, 2.0, 2.0], prompt_tokens=31)
    result = compare("q", {"radix": ours, "llamacpp": peer}, "radix")
    assert not result.agree and result.first_difference == 1
    assert result.verdict == "near tie" and result.margin == NEAR_TIE / 2
    assert result.prompt_tokens == {"radix": 30, "llamacpp": 31}
    ours = answer(["a", "b", "c"], [2.0, 3.0, 2.0])
    result = compare("q", {"radix": ours, "llamacpp": peer}, "radix")
    assert result.verdict == "real difference" and result.margin == 3.0


def completion(tokens: list[str], margins: list[float] | None = None) -> dict:
    """A /v1/completions answer; legacy logprobs only where ``margins`` are given."""
    choice: dict = {"text": "".join(tokens)}
    if margins is not None:
        choice["logprobs"] = {
            "tokens": tokens,
            "top_logprobs": [{t: -0.1, "other": -0.1 - m} for t, m in zip(tokens, margins,
                                                                           strict=True)],
        }  # fmt: skip
    return {"choices": [choice], "usage": {"prompt_tokens": 5}}


def test_completions_are_compared_by_text_and_placed_by_the_references_tokens():
    """A base model's answers: the peer gives no logprobs, the first differing character
    (inside the reference's third token) places the difference."""
    ours = completion([" Paris", ".", " It is", " big"], [2.0, 2.0, NEAR_TIE / 4, 2.0])
    peer = completion([" Paris", ".", " It was", " big"])
    result = compare("q", {"radix": ours, "llamacpp": peer}, "radix")
    assert not result.agree and result.first_difference == 2
    assert result.verdict == "near tie" and result.texts["llamacpp"] == " Paris. It was big"
    same = compare("q", {"radix": ours, "llamacpp": completion([" Paris. It is big"])}, "radix")
    assert same.agree


def test_a_server_label_keeps_its_kinds_penalty_parameter():
    """Two llama.cpp servers (``llamacpp`` and ``llamacpp:ubatch1``) both get llama.cpp's name
    for the penalty; a server of another kind gets the OpenAI-extension name."""
    assert penalty_off("llamacpp:ubatch1") == penalty_off("llamacpp") == {"repeat_penalty": 1.0}
    assert penalty_off("radix") == {"repetition_penalty": 1.0}
