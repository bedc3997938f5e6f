"""Running a ``ChatInput`` (api/chat_input.py), the request form the three chat APIs share:
render it with the chat template, fit ``max_tokens`` to the context left, build the engine
spec (the tenant's namespace, the prefill peer, the grammar, the prefixes to pin) and submit
it. Also what every
route checks first (the model name) and the spec fields every engine request of one HTTP
request shares. Each API's route module adds only its body, its response and its stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import StreamingResponse

from radixserve.api.answers import Recall, drawn_ids, encode_chat
from radixserve.api.chat_input import ChatInput
from radixserve.api.errors import ApiError
from radixserve.api.guard import cache_namespace
from radixserve.api.tool_stream import Piece, Text, ToolStream
from radixserve.engine.output import OutputTracker
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.spec import RequestSpec
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.serving import Job, Serving

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# On a decode instance: the prefill instance (its KV endpoint) to take the prompt's KV from;
# the router sets it per request (docs/fleet.md); who may choose which: ``prefill_trust.py``.
PREFILL_HEADER = "x-radixserve-prefill"
WARNING_HEADER = "x-radixserve-warning"  # what a request asked for that was left out

log = logging.getLogger("radixserve.server")


def check_model(name: str | None, served_model_name: str) -> None:
    if name is not None and name != served_model_name:
        raise ApiError(
            404,
            f"model {name!r} not found; this server serves {served_model_name!r}",
            "model",
            code="model_not_found",
        )


def request_spec(raw: Request, salt: str | None, **options: Any) -> RequestSpec:
    """What every engine request of this HTTP request shares (``Serving.submit`` gives
    each its id, prompt and sampling): the tenant's namespace, the prefill peer, RAG
    segments."""
    return RequestSpec(
        request_id="",
        prompt_ids=[],
        params=SamplingParams(),
        namespace=cache_namespace(getattr(raw.state, "tenant", None), salt),
        prefill_peer=raw.app.state.prefill_trust.peer(
            raw.headers.get(PREFILL_HEADER), raw.state.admin
        ),
        **options,
    )


def caller(raw: Request) -> str | None:
    """Whose request: the API key's holder (pin budget, stored responses, answers)."""
    return getattr(raw.state, "caller", None)


async def encode(
    serving: Serving, tokenizer: Tokenizer, chat: ChatInput, recall: Recall | None = None
) -> list[int]:
    """The prompt's token ids: the conversation and tools through the chat template, the
    answers ``recall`` knows as the model drew them (``api/answers.py``)."""
    messages, tools = chat.render(tokenizer.template_has_tools, recall)
    return await serving.off_loop(encode_chat, tokenizer, messages, tools)


async def start(
    serving: Serving, tokenizer: Tokenizer, chat: ChatInput, raw: Request, kind: str
) -> tuple[Job, asyncio.Queue]:
    """Submit ``chat``'s choices; ``kind`` prefixes the response id. Answers parsed with
    tools are remembered as drawn, for their caller's later requests."""
    if chat.notes:
        log.warning("%s %s: %s", raw.method, raw.url.path, "; ".join(chat.notes))
    tenant = caller(raw)
    recall = serving.answers.recall(tenant)
    ids = await encode(serving, tokenizer, chat, recall)
    info = serving.client.info
    params = chat.fitted(len(ids), min(info.max_model_len, info.kv_capacity_tokens))
    pins: tuple[tuple[int, float], ...] = ()
    if chat.cache_points and info.pin_budget_tokens:
        pins = await serving.off_loop(pin_ends, tokenizer, chat, ids, recall)
    elif chat.pins_asked:
        raise ApiError(400, "pins are off on this server (--pin-budget 0 or no prefix cache)",
                       "cache_pin")  # fmt: skip
    spec = request_spec(raw, chat.salt, grammar=chat.grammar, pins=pins, tenant=tenant)
    job, queue = await serving.submit(kind, [ids] * len(params), params, spec)
    plan = chat.plan
    if plan is not None:
        job.on_finish = lambda t: serving.answers.remember(
            tenant, plan, t.text, drawn_ids(tokenizer, t.token_ids, t.text)
        )
    return job, queue


def pin_ends(
    tokenizer: Tokenizer, chat: ChatInput, ids: list[int], recall: Recall | None = None
) -> tuple[tuple[int, float], ...]:
    """The prompt token where each cache point's prefix ends, with its ttl in seconds: the
    conversation through that message rendered alone, as far as it agrees with the prompt
    (a template may render a turn differently once others follow it)."""
    ends: dict[int, float] = {}
    for point in chat.cache_points:
        ends[point.message] = max(ends.get(point.message, 0.0), point.seconds)
    out = []
    prompt = np.asarray(ids)
    for message, ttl in sorted(ends.items()):
        conversation, tools = chat.render(tokenizer.template_has_tools, recall, message + 1)
        head = np.asarray(encode_chat(tokenizer, conversation, tools, False)[: len(ids)])
        differs = np.flatnonzero(head != prompt[: len(head)])
        end = int(differs[0]) if len(differs) else len(head)
        if end:
            out.append((end, ttl))
    return tuple(out)


def warning_headers(chat: ChatInput) -> dict[str, str]:
    """A warning header naming what was left out, if anything was."""
    if not chat.notes:
        return {}
    return {WARNING_HEADER: "; ".join(chat.notes).encode("ascii", "replace").decode()}


def new_pieces(parser: ToolStream | None, tracker: OutputTracker) -> list[Piece]:
    """The text and tool calls of what ``tracker`` has not given out yet (all text, with no
    tools in play); the parser's rest once the output ended."""
    text = tracker.take_stream_delta()[0]
    if parser is None:
        return [Text(text)] if text else []
    return parser.feed(text) + (parser.finish() if tracker.finished else [])


def sse_response(events: AsyncIterator[str], headers: dict[str, str] | None = None):
    """A streamed answer: server-sent ``events`` (``Serving.stream``)."""
    return StreamingResponse(
        events, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})}
    )
