"""The OpenAI Responses API: ``POST /v1/responses`` (streamed or not), ``GET`` and ``DELETE
/v1/responses/{id}``. The body becomes a ``ChatInput`` after the stored conversation of
``previous_response_id`` (``api/responses_api.py``, ``response_store.py``) and runs as every
chat request does (``chat_run.py``); this module writes the answer and stores it.

One encoder builds the response's output items from the text and tool calls
(``api/tool_stream.py``) for both forms: streamed, as the events the API sends, each with its
``sequence_number`` (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.content_part.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``, then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it); whole,
as the response those events end with. Usage: ``input_tokens_details.cached_tokens`` is the
prompt's part served from the cache (any tier). The opening events go out once the engine
has admitted the request (matched its prompt against the cache), and their usage already
holds the final input figures (output tokens so far: none); a stream kept waiting before
that sends SSE comments.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve.api.errors import ApiError
from radixserve.api.responses_api import ResponsesRequest
from radixserve.api.tool_stream import Call, Text
from radixserve.api.tools import ToolPlan, call_id
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.chat_run import check_model, new_pieces, sse_response, start, warning_headers
from radixserve.server.response_store import ResponseStore, StoredResponse
from radixserve.server.serving import Job, Serving, Wire

RESPONSES_PATH = "/v1/responses"
ECHOED = (
    "instructions",
    "max_output_tokens",
    "parallel_tool_calls",
    "previous_response_id",
    "store",
    "temperature",
    "top_p",
    "tool_choice",
    "tools",
    "metadata",
    "text",
    "reasoning",
    "truncation",
    "user",
    "prompt_cache_key",
)

# what the response says of a field the request left out: the value in effect
ECHO_DEFAULTS = {"instructions": None, "max_output_tokens": None, "parallel_tool_calls": True,
                 "previous_response_id": None, "store": True, "temperature": None,
                 "top_p": None, "tool_choice": "auto", "metadata": {},
                 "text": {"format": {"type": "text"}}, "reasoning": {"effort": None,
                 "summary": None}, "truncation": "disabled", "user": None,
                 "prompt_cache_key": None}  # fmt: skip


def usage(job: Job) -> dict[str, Any]:
    t = job.trackers[0]
    prompt, output = len(job.prompts[0]), len(t.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": t.usage.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


class ResponseEncoder:
    """The response of a job's one choice, as stream events (``events``) or whole
    (``response``, once the job finished); ``conversation`` gains the output turn."""

    def __init__(
        self,
        model: str,
        plan: ToolPlan | None,
        namespaces: dict[str, str],
        echo: dict[str, Any],
        conversation: list[dict[str, Any]],
    ):
        self.model, self.namespaces, self.echo = model, namespaces, echo
        self.parser = plan.stream() if plan is not None else None
        self.conversation = conversation
        self.output: list[dict[str, Any]] = []
        self.open = False  # the last output item is a message still being written
        self.started = False
        self.seq = 0
        self.created = int(time.time())

    def events(self, job: Job, index: int = 0) -> list[dict]:
        t = job.trackers[index]
        out = self._open(job)
        pieces = new_pieces(self.parser, t)
        for piece in pieces:
            out += self._text(piece) if isinstance(piece, Text) else self._call(piece)
        if t.finished:
            out += self._close()
            done = self.response(job)
            kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
            out.append(self._event(kind, response=done))
        return out

    def idle(self, job: Job) -> list[dict]:
        """The response's opening events once the request is admitted; nothing else (the
        Responses API has no keepalive event: the stream sends an SSE comment)."""
        return self._open(job) if job.trackers[0].admitted else []

    def _open(self, job: Job) -> list[dict]:
        """``response.created`` and ``response.in_progress`` once, their usage the input
        figures known from admission."""
        if self.started:
            return []
        self.started = True
        base = self._response(job, "in_progress")
        return [
            self._event("response.created", response=base),
            self._event("response.in_progress", response=base),
        ]

    def response(self, job: Job) -> dict[str, Any]:
        if not self.started or self.open:
            self.events(job)
        t = job.trackers[0]
        status = "incomplete" if t.finish_reason == "length" else "completed"
        return self._response(job, status)

    def error(self, e: ApiError) -> dict[str, Any]:
        return self._event("error", code=e.code or e.kind, message=e.message, param=e.param)

    def turn(self) -> dict[str, Any]:
        """The output as a chat turn, for the conversation a continuation extends."""
        text = "".join(
            p["text"] for i in self.output if i["type"] == "message" for p in i["content"]
        )
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.output
            if i["type"] == "function_call"
        ]
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

    def _response(self, job: Job, status: str) -> dict[str, Any]:
        finished = status != "in_progress"
        return {
            "id": "resp_" + job.response_id.split("-", 1)[-1],
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": self.output if finished else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "usage": usage(job),
            **self.echo,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _text(self, piece: Text) -> list[dict]:
        out: list[dict] = []
        if not self.open:
            item = {
                "type": "message",
                "id": call_id("msg_"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.output.append(item)
            self.open = True
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += [
                self._event(
                    "response.output_item.added",
                    output_index=len(self.output) - 1,
                    item={**item, "content": []},
                ),
                self._event("response.content_part.added", **self._where(), part=dict(part)),
            ]
            item["content"].append(part)
        self.output[-1]["content"][0]["text"] += piece.text
        return out + [
            self._event(
                "response.output_text.delta", **self._where(), delta=piece.text, logprobs=[]
            )
        ]

    def _call(self, piece: Call) -> list[dict]:
        out = self._close()
        item = {
            "type": "function_call",
            "id": call_id("fc_"),
            "call_id": call_id(),
            "name": piece.name,
            "arguments": "",
            "status": "in_progress",
        }
        if piece.name in self.namespaces:
            item["namespace"] = self.namespaces[piece.name]
        self.output.append(item)
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        out.append(
            self._event(
                "response.output_item.added", output_index=at["output_index"], item=dict(item)
            )
        )
        item.update(arguments=piece.arguments, status="completed")
        return out + [
            self._event("response.function_call_arguments.delta", **at, delta=piece.arguments),
            self._event(
                "response.function_call_arguments.done",
                **at,
                name=piece.name,
                arguments=piece.arguments,
            ),
            self._event(
                "response.output_item.done", output_index=at["output_index"], item=dict(item)
            ),
        ]

    def _where(self) -> dict[str, Any]:
        return {
            "item_id": self.output[-1]["id"],
            "output_index": len(self.output) - 1,
            "content_index": 0,
        }

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        item = self.output[-1]
        item["status"] = "completed"
        part = item["content"][0]
        return [
            self._event(
                "response.output_text.done", **self._where(), text=part["text"], logprobs=[]
            ),
            self._event("response.content_part.done", **self._where(), part=part),
            self._event("response.output_item.done", output_index=len(self.output) - 1, item=item),
        ]


def add_responses_routes(
    app: FastAPI,
    serving: Serving,
    tokenizer: Tokenizer,
    served_model_name: str,
    defaults: dict[str, Any],
) -> None:
    store = ResponseStore(serving.config.stored_responses)
    app.state.response_store = store

    def stored(raw: Request, response_id: str, param: str | None = None) -> StoredResponse:
        record = store.get(getattr(raw.state, "caller", None), response_id)
        if record is None:
            raise ApiError(
                404,
                f"no response with id {response_id!r} (unknown, deleted, or "
                "stored with store: false)",
                param,
            )
        return record

    @app.post(RESPONSES_PATH)
    async def create(body: ResponsesRequest, raw: Request):
        check_model(body.model, served_model_name)
        prev = body.previous_response_id
        history = stored(raw, prev, "previous_response_id").conversation if prev else []
        chat, namespaces = await serving.checked(lambda: body.to_chat_input(defaults, history))
        job, queue = await start(serving, tokenizer, chat, raw, "resp")
        given = body.model_dump(include=set(ECHOED), by_alias=True, exclude_none=True)
        echo = {**ECHO_DEFAULTS, **given, "tools": body.tools or []}
        # a continuation gives its own instructions: they stay out of the stored conversation
        conversation = chat.messages[1:] if body.instructions else chat.messages
        encoder = ResponseEncoder(served_model_name, chat.plan, namespaces, echo, conversation)
        caller = getattr(raw.state, "caller", None)

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                store.put(caller, StoredResponse(response, [*conversation, encoder.turn()]))

        headers = warning_headers(chat)
        if body.stream:
            wire = Wire(named=True, done="", error=encoder.error)

            def events(job: Job, index: int) -> list[dict]:
                out = encoder.events(job, index)
                if job.trackers[index].finished:
                    keep(out[-1]["response"])
                return out

            return sse_response(
                serving.stream(job, queue, events, lambda _: [], wire, encoder.idle), headers
            )
        await serving.wait(job, queue, raw)
        response = encoder.response(job)
        keep(response)
        return JSONResponse(response, headers=headers)

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def retrieve(response_id: str, raw: Request) -> JSONResponse:
        return JSONResponse(stored(raw, response_id).response)

    @app.delete(RESPONSES_PATH + "/{response_id}")
    async def delete(response_id: str, raw: Request) -> JSONResponse:
        stored(raw, response_id)
        store.delete(getattr(raw.state, "caller", None), response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
