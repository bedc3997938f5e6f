"""Greedy agreement between two OpenAI-compatible servers on the same chat prompts.

Each prompt is sent to every server as a non-streamed ``/v1/chat/completions`` call, greedy
(``temperature`` 0), with the repetition penalty off (``repetition_penalty`` 1 for
radixserve, ``repeat_penalty`` 1 for llama.cpp, each server's own name) and
``top_logprobs`` 2, so that a disagreement can be told apart:

- a *near tie*: at the first differing token, the reference server's two best candidates are
  within ``NEAR_TIE`` nats of each other (numerics of two engines may order them either way);
- a *real difference*: a clear margin, which points at a bug in one of them.

Also compared: the prompt token counts (``usage.prompt_tokens``), which show whether both
render the chat template and tokenize it alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import httpx

from radixserve.bench.client import check_server

NEAR_TIE = 0.5  # nats between the two best candidates

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the factorial of n.",
    "Explain what a hash map is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "What does the HTTP status code 404 mean?",
    "Write a SQL query that counts the rows of a table named users.",
    "Give one tip for writing readable code.",
]
PENALTY_OFF = {"llamacpp": {"repeat_penalty": 1.0}}
DEFAULT_PENALTY_OFF = {"repetition_penalty": 1.0}


@dataclass
class PromptResult:
    prompt: str
    prompt_tokens: dict[str, int]
    texts: dict[str, str]
    agree: bool
    first_difference: int | None = None  # token index
    margin: float | None = None  # reference's top-1 minus top-2 logprob there (nats)
    verdict: str = "same"  # same, near tie, real difference


async def chat(client: httpx.AsyncClient, url: str, system: str, prompt: str, n: int) -> dict:
    body: dict[str, Any] = {
        "model": await check_server(client, url),
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
        **PENALTY_OFF.get(system, DEFAULT_PENALTY_OFF),
    }
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


def tokens_of(answer: dict) -> list[dict]:
    return ((answer["choices"][0].get("logprobs") or {}).get("content")) or []


def compare(prompt: str, answers: dict[str, dict], reference: str) -> PromptResult:
    texts = {s: a["choices"][0]["message"]["content"] for s, a in answers.items()}
    counts = {s: a["usage"]["prompt_tokens"] for s, a in answers.items()}
    result = PromptResult(prompt, counts, texts, agree=len(set(texts.values())) == 1)
    if result.agree:
        return result
    ref = tokens_of(answers[reference])
    other = tokens_of(next(a for s, a in answers.items() if s != reference))
    i = next(
        (k for k, (a, b) in enumerate(zip(ref, other, strict=False)) if a["token"] != b["token"]),
        min(len(ref), len(other)),
    )
    result.first_difference = i
    if i < len(ref) and len(ref[i].get("top_logprobs") or []) >= 2:
        top = sorted((c["logprob"] for c in ref[i]["top_logprobs"]), reverse=True)
        result.margin = round(top[0] - top[1], 3)
        result.verdict = "near tie" if result.margin < NEAR_TIE else "real difference"
    else:
        result.verdict = "unexplained (no logprobs at the difference)"
    return result


async def greedy_agreement(
    client: httpx.AsyncClient, servers: dict[str, str], new_tokens: int = 32
) -> dict[str, Any]:
    """Every prompt on every server; the first server named is the reference for margins."""
    reference = next(iter(servers))
    results = []
    for prompt in CHAT_PROMPTS:
        answers = {s: await chat(client, url, s, prompt, new_tokens) for s, url in servers.items()}
        results.append(compare(prompt, answers, reference))
    return {
        "agree": sum(r.agree for r in results),
        "prompts": len(results),
        "same_prompt_tokens": sum(len(set(r.prompt_tokens.values())) == 1 for r in results),
        "results": [asdict(r) for r in results],
    }
