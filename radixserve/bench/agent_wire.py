"""The answers of the three chat APIs, read as an agent's client reads them: one ``Turn``
per request, filled from a stream of server-sent events or from a whole JSON body.

Well formed, for a stream, is the order each API promises: Messages opens with
``message_start``, every content block is started, given deltas of its own kind and stopped
before the next starts, one ``message_delta`` carries the stop reason, ``message_stop`` ends
it, and a tool call's input is a JSON object; Responses events carry increasing
``sequence_number``s from ``response.created`` to ``response.completed`` (or
``response.incomplete``), each output item added before its deltas and done after them, a
function call's arguments a JSON object; chat completions chunks are JSON objects and the
stream ends with ``[DONE]``. An ``error`` event is a problem. What breaks the order is
appended to ``turn.problems``; the readers never raise on a server's mistake, except on data
that is not JSON at all (the caller records that).

Usage: Messages' prompt is ``input_tokens + cache_read_input_tokens +
cache_creation_input_tokens`` (``message_start`` then ``message_delta``, the later winning),
cached is ``cache_read_input_tokens``; Responses' ``input_tokens`` and
``input_tokens_details.cached_tokens``; chat's ``prompt_tokens`` and
``prompt_tokens_details.cached_tokens``. A server that leaves cached tokens out but sends
llama.cpp's ``timings`` gets ``timings.cache_n``. A count the server did not send is None.
TTFT is the time to the first event that carries output (text or a tool call).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Turn:
    index: int
    method: str
    path: str
    api: str  # messages | count_tokens | responses | chat | other
    status: int
    streamed: bool = False
    problems: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None  # to the first output (text or a tool call)
    e2e_s: float | None = None
    text: str = ""
    tool_calls: list[str] = field(default_factory=list)  # the called tools' names
    stop: str | None = None  # stop reason, finish reason or final status
    error: str | None = None  # an HTTP error's message

    @property
    def cached_share(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens

    def row(self) -> dict[str, Any]:
        """The turn without its text, for a JSON report."""
        out = {k: v for k, v in asdict(self).items() if k != "text"}
        share = self.cached_share
        out["cached_share"] = None if share is None else round(share, 4)
        return out


@dataclass
class Event:
    name: str  # the ``event:`` field, "" when absent
    data: Any  # the parsed ``data:`` field; "[DONE]" stays a string
    time: float  # when the chunk that completed it arrived


def sse_events(chunks: list[tuple[float, bytes]]) -> list[Event]:
    """The server-sent events of timed chunks, each timed by the chunk that completed it.
    Comment lines (``:``) are skipped. Raises ValueError on data that is not JSON or a
    stream that ends inside an event."""
    events, buffer = [], ""
    for t, chunk in chunks:
        buffer += chunk.decode(errors="replace").replace("\r\n", "\n")
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            name, data = "", []
            for line in block.split("\n"):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
            if data:
                raw = "\n".join(data)
                events.append(Event(name, raw if raw == "[DONE]" else json.loads(raw), t))
    if buffer.strip():
        raise ValueError("the stream ends inside an event")
    return events


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text or "{}"), dict)
    except ValueError:
        return False


def _seen_output(turn: Turn, start: float, t: float) -> None:
    if turn.ttft_s is None:
        turn.ttft_s = t - start


def _messages_usage(turn: Turn, usage: dict[str, Any], timings: dict | None = None) -> None:
    parts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens",
                                    "cache_creation_input_tokens")]  # fmt: skip
    if parts[0] is not None:
        turn.prompt_tokens = sum(p or 0 for p in parts)
    if parts[1] is not None:
        turn.cached_tokens = parts[1]
    elif timings and "cache_n" in timings:
        turn.cached_tokens = timings["cache_n"]
    if usage.get("output_tokens") is not None:
        turn.output_tokens = usage["output_tokens"]


MESSAGES_DELTAS = {"text": "text_delta", "tool_use": "input_json_delta",
                   "thinking": "thinking_delta", "redacted_thinking": None}  # fmt: skip


def read_messages_stream(turn: Turn, events: list[Event], start: float) -> None:
    p = turn.problems
    kinds = [e.data.get("type") if isinstance(e.data, dict) else None for e in events]
    if not kinds or kinds[0] != "message_start":
        p.append("the stream does not open with message_start")
    if not kinds or kinds[-1] != "message_stop":
        p.append("the stream does not end with message_stop")
    blocks, open_block, usage, deltas = 0, None, {}, 0
    for e, kind in zip(events, kinds, strict=True):
        d = e.data
        if e.name and e.name != kind:
            p.append(f"event {e.name!r} carries data of type {kind!r}")
        if kind == "message_start":
            usage.update(d["message"].get("usage") or {})
        elif kind == "content_block_start":
            block = d["content_block"]
            if open_block is not None or d.get("index") != blocks:
                p.append(f"block {d.get('index')} starts out of order")
            open_block = {**block, "json": ""}
            blocks += 1
            if block["type"] == "tool_use":
                turn.tool_calls.append(block.get("name", "?"))
                _seen_output(turn, start, e.time)
        elif kind == "content_block_delta":
            delta = d["delta"]
            if open_block is None or d.get("index") != blocks - 1:
                p.append(f"a delta for block {d.get('index')}, which is not open")
                continue
            want = MESSAGES_DELTAS.get(open_block["type"])
            if delta["type"] != want and delta["type"] != "signature_delta":
                p.append(f"a {delta['type']} in a {open_block['type']} block")
            if delta["type"] == "text_delta":
                turn.text += delta["text"]
                _seen_output(turn, start, e.time)
            elif delta["type"] == "input_json_delta":
                open_block["json"] += delta["partial_json"]
        elif kind == "content_block_stop":
            if open_block is None or d.get("index") != blocks - 1:
                p.append(f"block {d.get('index')} stops but is not open")
            elif open_block["type"] == "tool_use" and not _json_object(open_block["json"]):
                p.append(f"the input of {open_block.get('name')} is not a JSON object")
            open_block = None
        elif kind == "message_delta":
            deltas += 1
            turn.stop = d["delta"].get("stop_reason")
            usage.update({k: v for k, v in (d.get("usage") or {}).items() if v is not None})
            _messages_usage(turn, usage, d.get("timings"))
        elif kind == "error":
            p.append(f"error event: {d.get('error')}")
        elif kind not in ("ping", "message_stop"):
            p.append(f"unknown event type {kind!r}")
    if open_block is not None:
        p.append("a block is never stopped")
    if deltas != 1:
        p.append(f"{deltas} message_delta events (1 expected)")
    if turn.prompt_tokens is None:
        _messages_usage(turn, usage)


def read_messages_body(turn: Turn, body: dict[str, Any], start: float) -> None:
    if body.get("type") != "message" or not isinstance(body.get("content"), list):
        turn.problems.append("the body is not a message")
        return
    for block in body["content"]:
        if block["type"] == "text":
            turn.text += block["text"]
        elif block["type"] == "tool_use":
            turn.tool_calls.append(block["name"])
            if not isinstance(block.get("input"), dict):
                turn.problems.append(f"the input of {block['name']} is not an object")
    turn.stop = body.get("stop_reason")
    _messages_usage(turn, body.get("usage") or {}, body.get("timings"))


def read_count_tokens(turn: Turn, body: dict[str, Any], start: float) -> None:
    if not isinstance(body.get("input_tokens"), int):
        turn.problems.append("no input_tokens in the count")
        return
    turn.prompt_tokens = body["input_tokens"]


def _responses_usage(turn: Turn, response: dict[str, Any]) -> None:
    usage = response.get("usage") or {}
    turn.prompt_tokens = usage.get("input_tokens")
    turn.output_tokens = usage.get("output_tokens")
    turn.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
    turn.stop = response.get("status")


RESPONSES_END = ("response.completed", "response.incomplete")


def read_responses_stream(turn: Turn, events: list[Event], start: float) -> None:
    p = turn.problems
    kinds = [e.data.get("type") for e in events]
    if not kinds or kinds[0] != "response.created":
        p.append("the stream does not open with response.created")
    if not kinds or kinds[-1] not in RESPONSES_END:
        p.append(f"the stream ends with {kinds[-1] if kinds else None}, not a final event")
    last_seq, items = -1, {}
    for e, kind in zip(events, kinds, strict=True):
        d = e.data
        if e.name and e.name != kind:
            p.append(f"event {e.name!r} carries data of type {kind!r}")
        seq = d.get("sequence_number")
        if not isinstance(seq, int) or seq <= last_seq:
            p.append(f"sequence_number {seq} after {last_seq}")
        last_seq = seq if isinstance(seq, int) else last_seq
        index = d.get("output_index")
        if kind == "response.output_item.added":
            if index in items or index != len(items):
                p.append(f"output item {index} added out of order")
            items[index] = "open"
            if d["item"]["type"] == "function_call":
                turn.tool_calls.append(d["item"].get("name", "?"))
                _seen_output(turn, start, e.time)
        elif kind == "response.output_item.done":
            if items.get(index) != "open":
                p.append(f"output item {index} done but not open")
            items[index] = "done"
            item = d["item"]
            if item["type"] == "function_call" and not _json_object(item.get("arguments", "")):
                p.append(f"the arguments of {item.get('name')} are not a JSON object")
        elif index is not None and items.get(index) != "open":
            p.append(f"{kind} for output item {index}, which is not open")
        if kind == "response.output_text.delta":
            turn.text += d["delta"]
            _seen_output(turn, start, e.time)
        elif kind in RESPONSES_END:
            _responses_usage(turn, d["response"])
        elif kind in ("error", "response.failed"):
            p.append(f"{kind}: {d.get('error') or d.get('response', {}).get('error')}")
    if any(state == "open" for state in items.values()):
        p.append("an output item is never done")


def read_responses_body(turn: Turn, body: dict[str, Any], start: float) -> None:
    if body.get("object") != "response" or not isinstance(body.get("output"), list):
        turn.problems.append("the body is not a response")
        return
    for item in body["output"]:
        if item["type"] == "message":
            turn.text += "".join(c.get("text", "") for c in item["content"])
        elif item["type"] == "function_call":
            turn.tool_calls.append(item["name"])
    _responses_usage(turn, body)


def _chat_usage(turn: Turn, usage: dict[str, Any], timings: dict | None) -> None:
    turn.prompt_tokens = usage.get("prompt_tokens")
    turn.output_tokens = usage.get("completion_tokens")
    turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if turn.cached_tokens is None and timings and "cache_n" in timings:
        turn.cached_tokens = timings["cache_n"]


def read_chat_stream(turn: Turn, events: list[Event], start: float) -> None:
    if not events or events[-1].data != "[DONE]":
        turn.problems.append("the stream does not end with [DONE]")
    calls: dict[int, str] = {}
    for e in events[:-1] if events else []:
        d = e.data
        if not isinstance(d, dict) or "choices" not in d:
            turn.problems.append(f"a chunk that is not a completion chunk: {str(d)[:200]}")
            continue
        if "error" in d:
            turn.problems.append(f"error chunk: {d['error']}")
        for choice in d["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                turn.text += delta["content"]
                _seen_output(turn, start, e.time)
            for call in delta.get("tool_calls") or []:
                if call.get("function", {}).get("name"):
                    calls[call.get("index", 0)] = call["function"]["name"]
                    _seen_output(turn, start, e.time)
            turn.stop = choice.get("finish_reason") or turn.stop
        if d.get("usage"):
            _chat_usage(turn, d["usage"], d.get("timings"))
    turn.tool_calls += [calls[i] for i in sorted(calls)]


def read_chat_body(turn: Turn, body: dict[str, Any], start: float) -> None:
    if body.get("object") != "chat.completion" or not body.get("choices"):
        turn.problems.append("the body is not a chat completion")
        return
    message = body["choices"][0]["message"]
    turn.text = message.get("content") or ""
    turn.tool_calls = [c["function"]["name"] for c in message.get("tool_calls") or []]
    turn.stop = body["choices"][0].get("finish_reason")
    _chat_usage(turn, body.get("usage") or {}, body.get("timings"))


Reader = Callable[[Turn, Any, float], None]
STREAM_READERS: dict[str, Reader] = {
    "messages": read_messages_stream,
    "responses": read_responses_stream,
    "chat": read_chat_stream,
}
BODY_READERS: dict[str, Reader] = {
    "messages": read_messages_body,
    "count_tokens": read_count_tokens,
    "responses": read_responses_body,
    "chat": read_chat_body,
}
