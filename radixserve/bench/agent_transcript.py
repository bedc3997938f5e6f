"""An agent's session as the server saw it: the recorded exchanges (``agent_proxy.py``) read
as ``Turn``s of the API each used (``agent_wire.py``), the cache figures per request, and the
whole transcript saved for reading.

``read_turns`` reads every exchange: the API from its path, the status, the answer (streamed
or whole) and its usage. ``model_turns`` keeps those that ran the model (Messages,
Responses, chat completions). ``cache_rows`` gives each of them as prompt tokens, cached
tokens and their share: in an agent's session every request after the first re-sends a
prompt whose head the server has computed before. ``save_transcript`` writes every exchange
as one JSON line (request body, status, response body as text, times), so that a session
that went wrong can be read afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from radixserve.bench.agent_proxy import STREAM_CUT, Exchange
from radixserve.bench.agent_wire import BODY_READERS, STREAM_READERS, Turn, sse_events

API_PATHS = {"/v1/messages/count_tokens": "count_tokens", "/v1/messages": "messages",
             "/v1/responses": "responses", "/v1/chat/completions": "chat"}  # fmt: skip
MODEL_APIS = ("messages", "responses", "chat")


def api_of(method: str, path: str) -> str:
    """The API a request used, from its method and path (a query string is ignored)."""
    if method != "POST":
        return "other"
    return API_PATHS.get(path.split("?", 1)[0].rstrip("/"), "other")


def read_turns(exchanges: list[Exchange]) -> list[Turn]:
    return [read_turn(i, ex) for i, ex in enumerate(exchanges)]


def read_turn(index: int, ex: Exchange) -> Turn:
    turn = Turn(index, ex.method, ex.path, api_of(ex.method, ex.path), ex.status)
    if ex.end is not None:
        turn.e2e_s = ex.end - ex.start
    cut = ex.error is not None and ex.error.startswith(STREAM_CUT)
    if ex.error and not cut:
        turn.problems.append(ex.error)
    if ex.status >= 400 or ex.status == 0:
        turn.error = error_message(ex.body) or ex.error
        turn.problems.append(f"HTTP {ex.status}: {turn.error}")
        return turn
    if turn.api == "other":
        return turn
    turn.streamed = "text/event-stream" in ex.response_headers.get("content-type", "")
    try:
        if turn.streamed:
            STREAM_READERS[turn.api](turn, sse_events(ex.chunks), ex.start)
        else:
            BODY_READERS[turn.api](turn, json.loads(ex.body), ex.start)
            if ex.chunks:
                turn.ttft_s = ex.chunks[0][0] - ex.start
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        turn.problems.append(f"unreadable answer: {type(e).__name__}: {e}")
    if cut and (not turn.streamed or turn.problems):
        # a stream whose final event arrived was whole: a client may hang up on reading it
        # (Codex does) before the server's end of the body reaches the proxy
        turn.problems.append(ex.error)
    return turn


def error_message(body: bytes) -> str | None:
    """The message of an error body in any of the three APIs' shapes, else its text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500] or None
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)


def model_turns(turns: list[Turn]) -> list[Turn]:
    """The turns that ran the model (not token counts, model lists, ...)."""
    return [t for t in turns if t.api in MODEL_APIS]


def cache_rows(turns: list[Turn]) -> list[dict[str, Any]]:
    """Per model turn: prompt tokens, cached tokens, their share, TTFT and end to end."""
    return [
        {"i": t.index, "api": t.api, "status": t.status, "prompt": t.prompt_tokens,
         "cached": t.cached_tokens, "share": None if t.cached_share is None
         else round(t.cached_share, 4), "ttft_s": _round(t.ttft_s), "e2e_s": _round(t.e2e_s),
         "stop": t.stop, "calls": t.tool_calls}
        for t in model_turns(turns)
    ]  # fmt: skip


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def problems(turns: list[Turn]) -> list[str]:
    """Every problem of every turn, each naming its turn."""
    return [f"#{t.index} {t.method} {t.path}: {p}" for t in turns for p in t.problems]


def save_transcript(exchanges: list[Exchange], path: Path) -> Path:
    """Every exchange as one JSON line: request, status, answer (as text), times relative to
    the first request."""
    t0 = exchanges[0].start if exchanges else 0.0
    with open(path, "w") as f:
        for ex in exchanges:
            line = {
                "method": ex.method, "path": ex.path, "status": ex.status,
                "request_headers": ex.request_headers,
                "request": _maybe_json(ex.request_body),
                "response": ex.body.decode(errors="replace"),
                "start_s": round(ex.start - t0, 3),
                "end_s": None if ex.end is None else round(ex.end - t0, 3), "error": ex.error,
            }  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return path


def _maybe_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
