"""Greedy agreement between two OpenAI-compatible servers on the same prompts.

Each prompt is sent to every server as a non-streamed ``/v1/chat/completions`` call (a model
without a chat template, a base model: text openers as ``/v1/completions`` calls), greedy
(``temperature`` 0), with the repetition penalty off (``repetition_penalty`` 1 for
radixserve, ``repeat_penalty`` 1 for llama.cpp, each server's own name) and
two top logprobs, so that a disagreement can be told apart:

- a *near tie*: at the first differing token, the reference server's two best candidates are
  within ``NEAR_TIE`` nats of each other (numerics of two engines may order them either way);
- a *real difference*: a clear margin, which points at a bug in one of them.

Completions compare the answers' texts; the first difference is the reference's token that
holds the first differing character (only the reference's logprobs are asked for).

Also compared: the prompt token counts (``usage.prompt_tokens``), which show whether both
render the chat template and tokenize it alike.

Servers are named by their kind, optionally with a label after a colon (``llamacpp:ubatch1``),
so that two servers of one kind can be compared; the kind picks the penalty's parameter name.
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
COMPLETION_PROMPTS = [
    "The capital of France is",
    "def factorial(n):",
    "A hash map is a data structure that",
    "The three primary colors are",
    "To reverse a list in Python, you can",
    "The HTTP status code 404 means",
    "SELECT COUNT(*) FROM users",
    "Once upon a time, in a small village,",
]
PENALTY_OFF = {"llamacpp": {"repeat_penalty": 1.0}}
DEFAULT_PENALTY_OFF = {"repetition_penalty": 1.0}


def penalty_off(system: str) -> dict[str, float]:
    """The body fields that turn the repetition penalty off on server ``system``."""
    return PENALTY_OFF.get(system.split(":", 1)[0], DEFAULT_PENALTY_OFF)


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
        **penalty_off(system),
    }
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


async def complete(
    client: httpx.AsyncClient, url: str, system: str, prompt: str, n: int, reference: bool
) -> dict:
    body: dict[str, Any] = {
        "model": await check_server(client, url),
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        **({"logprobs": 2} if reference else {}),
        **penalty_off(system),
    }
    response = await client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    return response.json()


def tokens_of(answer: dict) -> list[dict]:
    """The answer's tokens as ``{"token", "top_logprobs": [{"logprob"}]}`` (chat's layout;
    a completion's legacy logprobs are rewritten into it)."""
    logprobs = answer["choices"][0].get("logprobs") or {}
    if "content" in logprobs:
        return logprobs["content"] or []
    tops = logprobs.get("top_logprobs") or []
    return [
        {"token": t, "top_logprobs": [{"logprob": v} for v in (top or {}).values()]}
        for t, top in zip(logprobs.get("tokens") or [], tops, strict=False)
    ]


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def first_difference(texts: list[str], ref: list[dict], other: list[dict]) -> int:
    """Index of the reference's first token that differs: by tokens where both servers gave
    them, else the token holding the first differing character of the texts."""
    if other:
        pairs = enumerate(zip(ref, other, strict=False))
        return next((k for k, (a, b) in pairs if a["token"] != b["token"]),
                    min(len(ref), len(other)))  # fmt: skip
    a, b = texts[0], texts[1]
    same = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))  # fmt: skip
    end = 0
    for k, token in enumerate(ref):
        end += len(token["token"])
        if end > same:
            return k
    return len(ref)


def compare(prompt: str, answers: dict[str, dict], reference: str) -> PromptResult:
    texts = {s: text_of(a) for s, a in answers.items()}
    counts = {s: a["usage"]["prompt_tokens"] for s, a in answers.items()}
    result = PromptResult(prompt, counts, texts, agree=len(set(texts.values())) == 1)
    if result.agree:
        return result
    ref = tokens_of(answers[reference])
    other_name = next(s for s in answers if s != reference)
    other = tokens_of(answers[other_name])
    i = first_difference([texts[reference], texts[other_name]], ref, other)
    result.first_difference = i
    if i < len(ref) and len(ref[i].get("top_logprobs") or []) >= 2:
        top = sorted((c["logprob"] for c in ref[i]["top_logprobs"]), reverse=True)
        result.margin = round(top[0] - top[1], 3)
        result.verdict = "near tie" if result.margin < NEAR_TIE else "real difference"
    else:
        result.verdict = "unexplained (no logprobs at the difference)"
    return result


async def greedy_agreement(
    client: httpx.AsyncClient, servers: dict[str, str], new_tokens: int = 32, chat_model=True
) -> dict[str, Any]:
    """Every prompt on every server; the first server named is the reference for margins.
    ``chat_model`` False: the model has no chat template, completion prompts are used."""
    reference = next(iter(servers))
    results = []
    for prompt in CHAT_PROMPTS if chat_model else COMPLETION_PROMPTS:
        answers = {}
        for s, url in servers.items():
            if chat_model:
                answers[s] = await chat(client, url, s, prompt, new_tokens)
            else:
                answers[s] = await complete(client, url, s, prompt, new_tokens, s == reference)
        results.append(compare(prompt, answers, reference))
    return {
        "mode": "chat" if chat_model else "completion",
        "agree": sum(r.agree for r in results),
        "prompts": len(results),
        "same_prompt_tokens": sum(len(set(r.prompt_tokens.values())) == 1 for r in results),
        "results": [asdict(r) for r in results],
    }
