"""Bad input on the agent APIs (``/v1/messages``, ``/v1/messages/count_tokens``,
``/v1/responses`` and ``GET``/``DELETE /v1/responses/{id}``) against a real server (tiny
model): malformed and unknown blocks and items, results for calls never made, response ids
that do not exist or belong to another tenant, bodies that are not JSON or are over the limit
(announced or streamed). Each gets a 4xx in the error shape of the API called; afterwards the
server is whole (``check_integrity``) and what it had cached is still cached."""

from __future__ import annotations

import httpx
import pytest

from testing.agents import (
    KEYS,
    MAX_REQUEST_BYTES,
    agent_server_flags,
    assert_whole,
)
from testing.server import running_server

A, B = ({"Authorization": f"Bearer {k}"} for k in KEYS)
MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
REMEMBER = [{"role": "user", "content": "Remember this sentence about radix trees."}]
CACHED = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": REMEMBER}


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    with running_server(*agent_server_flags(tiny_model_dir)) as url:
        yield url


def anthropic_error(r: httpx.Response, status: int, words: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert words in body["error"]["message"], body


def openai_error(r: httpx.Response, status: int, words: str = "") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert words in error["message"], error


def messages_body(**change):
    return {"model": "tiny", "max_tokens": 4, "messages": ASK, **change}


def user(*blocks):
    return [{"role": "user", "content": list(blocks)}]


MALFORMED_MESSAGES = [
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"messages": user({"type": "text"})}, "text"),
    ({"messages": user({"type": "text", "text": 5})}, "text"),
    ({"messages": user({"type": "hologram", "data": "x"})}, "hologram"),
    ({"messages": user({"no_type": True})}, "messages"),
    ({"messages": user({"type": "tool_result", "content": "1"})}, "tool_use_id"),
    ({"messages": ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
      "name": "f", "input": "not an object"}]}]}, "input"),
    ({"messages": ASK + [{"role": "assistant", "content": "ok"}] + user(
        {"type": "tool_result", "tool_use_id": "toolu_never", "content": "1"})}, "toolu_never"),
    ({"system": [{"type": "image", "source": {}}]}, "system"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {
        "type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": -1}, "max_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("path", [MESSAGES, COUNT])
@pytest.mark.parametrize("change, words", MALFORMED_MESSAGES)
def test_malformed_messages_get_anthropic_errors(url, path, change, words):
    body = messages_body(**change)
    if path == COUNT:
        body.pop("max_tokens")
        if "max_tokens" in change:
            return  # count_tokens has no max_tokens
    anthropic_error(httpx.post(url + path, json=body, headers=A, timeout=60), 400, words)


def items(*entries):
    return {"model": "tiny", "max_output_tokens": 4, "input": list(entries)}


MALFORMED_RESPONSES = [
    ({"model": "tiny", "input": 5}, "input"),
    (items({"type": "message", "role": "user", "content": [{"type": "input_video"}]}),
     "input_video"),
    (items({"type": "hologram"}), "hologram"),
    (items({"type": "message", "role": "wizard", "content": "hi"}), "role"),
    (items({"type": "message", "role": "user"}), "content"),
    (items({"type": "function_call", "name": "f", "arguments": "{}"}), "call_id"),
    (items({"type": "function_call_output", "call_id": "call_never", "output": "1"}),
     "call_never"),
    (items({"type": "function_call_output", "output": "1"}), "call_id"),
    ({"model": "tiny", "input": "hi", "tools": [{"type": "function"}]}, "name"),
    ({"model": "tiny", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "tiny", "input": "hi", "previous_response_id": 7}, "previous_response_id"),
]  # fmt: skip


@pytest.mark.parametrize("body, words", MALFORMED_RESPONSES)
def test_malformed_responses_get_openai_errors(url, body, words):
    openai_error(httpx.post(url + RESPONSES, json=body, headers=A, timeout=60), 400, words)


def test_response_ids_stay_with_their_tenant(url):
    mine = httpx.post(url + RESPONSES, json={"model": "tiny", "input": "hi",
                      "max_output_tokens": 2}, headers=A, timeout=60).json()["id"]  # fmt: skip
    where = f"{url}{RESPONSES}/{mine}"
    for method in ("GET", "DELETE"):
        openai_error(httpx.request(method, where, headers=B, timeout=30), 404, mine)
        nope = f"{url}{RESPONSES}/resp_nope"
        openai_error(httpx.request(method, nope, headers=A, timeout=30), 404, "resp_nope")
    chained = {"model": "tiny", "input": "and?", "max_output_tokens": 2,
               "previous_response_id": mine}  # fmt: skip
    openai_error(httpx.post(url + RESPONSES, json=chained, headers=B, timeout=60), 404, mine)
    assert httpx.get(where, headers=A, timeout=30).status_code == 200  # B deleted nothing
    assert httpx.post(url + RESPONSES, json=chained, headers=A, timeout=60).status_code == 200
    assert_whole(url)


@pytest.mark.parametrize("path", [MESSAGES, COUNT, RESPONSES])
def test_bodies_that_are_not_json_or_too_large(url, path):
    check = anthropic_error if path.startswith(MESSAGES) else openai_error
    json_type = {**A, "content-type": "application/json"}
    check(httpx.post(url + path, content=b"{not json", headers=json_type, timeout=30), 400)
    check(httpx.post(url + path, content=b"\xff\xfe", headers=json_type, timeout=30), 400)
    big = b'{"model": "tiny", "input": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
    check(httpx.post(url + path, content=big, headers=json_type, timeout=60), 413)

    def streamed():  # no Content-Length: the limit is found while reading
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    check(httpx.post(url + path, content=streamed(), headers=json_type, timeout=60), 413)


def test_bad_input_leaves_the_cache_whole(url):
    """A prompt computed before a burst of bad requests is still served from the cache
    after it, and the tree's bookkeeping holds."""
    first = httpx.post(url + MESSAGES, json=CACHED, headers=A, timeout=60).json()["usage"]
    for change, _ in MALFORMED_MESSAGES:
        httpx.post(url + MESSAGES, json=messages_body(**change), headers=A, timeout=60)
    for body, _ in MALFORMED_RESPONSES:
        httpx.post(url + RESPONSES, json=body, headers=A, timeout=60)
    again = httpx.post(url + MESSAGES, json=CACHED, headers=A, timeout=60).json()["usage"]
    prompt = first["input_tokens"] + first["cache_read_input_tokens"]
    assert again["cache_read_input_tokens"] == prompt - 1, (first, again)
    assert_whole(url)
