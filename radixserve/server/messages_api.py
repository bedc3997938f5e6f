"""The Anthropic Messages API: ``POST /v1/messages`` (streamed or not) and
``POST /v1/messages/count_tokens``. The body becomes a ``ChatInput`` (``api/anthropic.py``)
and runs as every chat request does (``chat_run.py``); this module writes the answer.

One encoder builds the message from the output's text and tool calls (``api/tool_stream.py``)
for both forms: streamed, as the events the Messages API sends (``message_start``, ``ping``,
``content_block_start``, ``content_block_delta`` with ``text_delta`` or ``input_json_delta``,
``content_block_stop``, ``message_delta`` with the stop reason and usage, ``message_stop``);
whole, as the message those events add up to. ``stop_reason``: ``tool_use`` when the output
holds calls, ``max_tokens``, ``stop_sequence`` (with the sequence), else ``end_turn``.
Usage: ``input_tokens`` is the prompt's uncached part and ``cache_read_input_tokens`` the part
served from the cache (any tier); every computed token enters the cache without a write
being asked for, so ``cache_creation_input_tokens`` is 0. ``message_start`` goes out once
the engine has admitted the request (matched its prompt against the cache), so its usage
already holds the final input figures; a stream kept waiting before that (a queue, a
storage fetch) sends ``ping`` events meanwhile. Errors, streamed or not, take
Anthropic's shape (``api/errors.py``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve.api.anthropic import CountTokensRequest, MessagesRequest
from radixserve.api.tool_stream import Call, Piece, Text
from radixserve.api.tools import ToolPlan, call_id
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.chat_run import (
    caller,
    check_model,
    encode,
    new_pieces,
    sse_response,
    start,
    warning_headers,
)
from radixserve.server.serving import Job, Serving, Wire

MESSAGES_PATH = "/v1/messages"
WIRE = Wire(named=True, done="", error=lambda e: e.body(MESSAGES_PATH))


def usage(job: Job) -> dict[str, int]:
    t = job.trackers[0]
    prompt, cached = len(job.prompts[0]), t.usage.cached_tokens
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": len(t.token_ids),
    }


class MessageEncoder:
    """The message of a job's one choice, as stream events (``events``) or whole
    (``message``, once the job finished)."""

    def __init__(self, model: str, plan: ToolPlan | None):
        self.model = model
        self.parser = plan.stream() if plan is not None else None
        self.content: list[dict[str, Any]] = []
        self.open = False  # the last block is still open
        self.started = False

    def events(self, job: Job, index: int = 0) -> list[dict]:
        t = job.trackers[index]
        out = self._open(job)
        pieces = new_pieces(self.parser, t)
        for piece in pieces:
            out += self._piece(piece)
        if t.finished:
            out += self._close()
            delta = {"stop_reason": self._stop_reason(job), "stop_sequence": t.stop_string}
            out += [
                {"type": "message_delta", "delta": delta, "usage": usage(job)},
                {"type": "message_stop"},
            ]
        return out

    def idle(self, job: Job) -> list[dict]:
        """A ``ping`` (a stream whose request waits or whose prompt is still being read is
        seen to be alive), after ``message_start`` if the request was admitted since."""
        opening = self._open(job) if job.trackers[0].admitted else []
        return [*opening, {"type": "ping"}]

    def _open(self, job: Job) -> list[dict]:
        """``message_start`` once, with the usage known from admission: sent before it,
        its usage would count cached tokens as uncached."""
        if self.started:
            return []
        self.started = True
        return [{"type": "message_start", "message": self._body(job, None)}]

    def message(self, job: Job) -> dict[str, Any]:
        self.events(job)
        return self._body(job, self._stop_reason(job))

    def _body(self, job: Job, stop_reason: str | None) -> dict[str, Any]:
        t = job.trackers[0]
        return {
            "id": "msg_" + job.response_id.split("-", 1)[-1],
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content if stop_reason else [],
            "stop_reason": stop_reason,
            "stop_sequence": t.stop_string if stop_reason else None,
            "usage": usage(job),
        }

    def _stop_reason(self, job: Job) -> str:
        t = job.trackers[0]
        if any(b["type"] == "tool_use" for b in self.content):
            return "tool_use"
        if t.finish_reason == "length":
            return "max_tokens"
        return "stop_sequence" if t.stop_string is not None else "end_turn"

    def _piece(self, piece: Piece) -> list[dict]:
        out: list[dict] = []
        if isinstance(piece, Text) and self.open and self.content[-1]["type"] == "text":
            self.content[-1]["text"] += piece.text
        else:
            out += self._close()
            block = (
                {"type": "text", "text": piece.text}
                if isinstance(piece, Text)
                else {
                    "type": "tool_use",
                    "id": call_id("toolu_"),
                    "name": piece.name,
                    "input": json.loads(piece.arguments),
                }
            )
            self.content.append(block)
            self.open = True
            start = {**block, "text": ""} if block["type"] == "text" else {**block, "input": {}}
            out.append(
                {
                    "type": "content_block_start",
                    "index": len(self.content) - 1,
                    "content_block": start,
                }
            )
        index = len(self.content) - 1
        if isinstance(piece, Call):
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            out.append({"type": "content_block_delta", "index": index, "delta": delta})
            return out + self._close()
        delta = {"type": "text_delta", "text": piece.text}
        return out + [{"type": "content_block_delta", "index": index, "delta": delta}]

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def add_messages_routes(
    app: FastAPI,
    serving: Serving,
    tokenizer: Tokenizer,
    served_model_name: str,
    defaults: dict[str, Any],
) -> None:
    """``/v1/messages`` and ``/v1/messages/count_tokens`` (a ``?beta=true`` query and the
    ``anthropic-version`` / ``anthropic-beta`` headers are accepted: they select API
    versions and features of Anthropic's service, and this server speaks one)."""

    @app.post(MESSAGES_PATH)
    async def messages(body: MessagesRequest, raw: Request):
        check_model(body.model, served_model_name)
        chat = await serving.checked(lambda: body.to_chat_input(defaults))
        job, queue = await start(serving, tokenizer, chat, raw, "msg")
        encoder = MessageEncoder(served_model_name, chat.plan)
        headers = warning_headers(chat)
        if body.stream:
            return sse_response(
                serving.stream(job, queue, encoder.events, lambda _: [], WIRE, encoder.idle),
                headers,
            )
        await serving.wait(job, queue, raw)
        return JSONResponse(encoder.message(job), headers=headers)

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(body: CountTokensRequest, raw: Request) -> JSONResponse:
        check_model(body.model, served_model_name)
        chat = await serving.checked(lambda: body.to_chat_input(defaults))
        ids = await encode(serving, tokenizer, chat, serving.answers.recall(caller(raw)))
        return JSONResponse({"input_tokens": len(ids)}, headers=warning_headers(chat))
