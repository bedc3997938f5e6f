"""The Anthropic Messages API against a real server (tiny model): the whole message and the
stream's exact event sequence agree, stop reasons, usage from the cache, tool use forced and
answered, count_tokens, and every refusal in Anthropic's error shape; the server is whole
after each (``check_integrity``)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from testing.agents import (
    ADMIN,
    CONTEXT,
    KEYS,
    MAX_REQUEST_BYTES,
    assert_whole,
    sse_events,
)

URL_PATH = "/v1/messages"
GREEDY = {"temperature": 0}  # the SDK has no temperature argument any more
HEADERS = {"x-api-key": KEYS[0], "anthropic-version": "2023-06-01",
           "anthropic-beta": "claude-code-20250219"}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string",
            "maxLength": 20}}, "required": ["city"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture
def url(agent_url):  # one server for this module and the other agent API's (conftest.py)
    return agent_url


def post(url, body, headers=HEADERS, path=URL_PATH):
    return httpx.post(url + path + "?beta=true", json=body, headers=headers, timeout=60)


def message(**extra):
    return {"model": "tiny", "max_tokens": 12, "temperature": 0, "messages": ASK, **extra}


def test_stream_events_add_up_to_the_whole_message(url):
    whole = post(url, message()).json()
    assert whole["type"] == "message" and whole["role"] == "assistant"
    assert whole["stop_reason"] == "max_tokens" and whole["usage"]["output_tokens"] == 12
    r = httpx.post(url + URL_PATH, json=message(stream=True), headers=HEADERS, timeout=60)
    events = [(n, d) for n, d in sse_events(r.text) if n != "ping"]  # when it was slow
    names = [name for name, _ in events]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(name == data["type"] for name, data in events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert [{"type": "text", "text": text}] == whole["content"]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    usage = delta["usage"]
    # the same prompt again: all but its last token comes from the cache
    assert usage["cache_read_input_tokens"] == sum(whole["usage"][k] for k in (
        "input_tokens", "cache_read_input_tokens")) - 1 and usage["input_tokens"] == 1  # fmt: skip
    assert usage["cache_creation_input_tokens"] == 0
    # message_start, sent once the request was admitted, already says what was cached
    opening = events[0][1]["message"]["usage"]
    assert {**opening, "output_tokens": 12} == usage
    assert_whole(url)


def test_message_start_reports_the_cache_hit_before_the_first_token(url):
    """A prompt prefilled over several steps (over 256 new tokens: the CPU's chunk): its
    ``message_start`` goes out when it is admitted, before its first token, and already
    counts the shared system prompt as cached, as the final usage does."""
    system = "You answer questions about the weather in short sentences. " * 6
    post(url, message(system=system, max_tokens=1))  # the system prompt is now cached
    question = " ".join(f"city{i}" for i in range(150)) + ": which is the coldest?"
    body = message(system=system, max_tokens=2, stream=True,
                   messages=[{"role": "user", "content": question}])  # fmt: skip
    events = [(n, d) for n, d in sse_events(post(url, body).text) if n != "ping"]
    opening = events[0][1]["message"]["usage"]
    final = events[-2][1]["usage"]
    assert opening["output_tokens"] == 0  # sent before the first token was drawn
    assert opening["cache_read_input_tokens"] > 40 and opening["input_tokens"] > 256
    assert {**opening, "output_tokens": final["output_tokens"]} == final
    assert_whole(url)


def test_a_stop_sequence_ends_the_message_and_is_named(url):
    text = post(url, message()).json()["content"][0]["text"]
    stop = text[len(text) // 2 :][:2]  # greedy: the same output comes again, up to it
    out = post(url, message(stop_sequences=[stop])).json()
    assert out["stop_reason"] == "stop_sequence" and out["stop_sequence"] == stop
    kept = out["content"][0]["text"] if out["content"] else ""
    assert kept == text[: text.find(stop)].rstrip() or kept == text[: text.find(stop)]


def test_forced_tool_use_streams_input_json_and_a_result_round_trip_is_cached(url):
    client = anthropic.Anthropic(base_url=url, api_key=KEYS[0], max_retries=0)
    anyone = client.messages.create(model="tiny", max_tokens=60, messages=ASK, tools=[WEATHER],
                                    tool_choice={"type": "any"}, extra_body=GREEDY)  # fmt: skip
    assert anyone.stop_reason in ("tool_use", "max_tokens")  # an array of calls may run on
    one = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = client.messages.create(model="tiny", max_tokens=60, messages=ASK, tools=[WEATHER],
                                   tool_choice=one, extra_body=GREEDY)  # fmt: skip
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    r = post(url, message(tools=[WEATHER], max_tokens=60, stream=True, tool_choice=one))
    events = sse_events(r.text)
    start = next(d for n, d in events if n == "content_block_start")["content_block"]
    assert start["type"] == "tool_use" and start["input"] == {}
    parts = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {p["type"] for p in parts} == {"input_json_delta"}
    assert json.loads("".join(p["partial_json"] for p in parts)) == call.input  # greedy
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "rain, 14 C"}]}]},
    ]  # fmt: skip
    second = client.messages.create(model="tiny", max_tokens=8, messages=history,
                                    tools=[WEATHER], extra_body=GREEDY)  # fmt: skip
    before = first.usage.input_tokens + first.usage.cache_read_input_tokens
    # the call re-sent renders as the model wrote it: all but the last token it drew
    assert second.usage.cache_read_input_tokens >= before + first.usage.output_tokens - 1
    counted = client.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER])
    u = second.usage
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens
    assert_whole(url)


def test_claude_code_shaped_request_is_served(url):
    """The fields Claude Code sends, in its shape (our own text): an attribution block, cache
    breakpoints, a mid-conversation system turn, adaptive thinking, effort, context edits,
    metadata, and a max_tokens far over the context left, which is lowered to what remains."""
    body = {
        "model": "tiny", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0.abc;"},
                   {"type": "text", "text": "You help with code.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<context>today</context>"},
                {"type": "text", "text": "Read notes.txt", "cache_control": {
                    "type": "ephemeral", "ttl": "1h"}}]},
            {"role": "system", "content": "Agent types: general."},
        ],
        "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
        "metadata": {"user_id": json.dumps({"session_id": "s1"})},
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }  # fmt: skip
    r = post(url, body)
    assert r.status_code == 200, r.text
    assert "web_search" in r.headers["x-radixserve-warning"]
    events = sse_events(r.text)
    assert events[-1][0] == "message_stop"
    done = events[-2][1]
    assert done["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    prompt = done["usage"]["input_tokens"] + done["usage"]["cache_read_input_tokens"]
    if done["delta"]["stop_reason"] == "max_tokens":  # the context, less the prompt
        assert done["usage"]["output_tokens"] == CONTEXT - prompt
    assert_whole(url)


def test_deferred_tools_stay_out_of_the_prompt_and_thinking_display_is_advice(url):
    """Claude Code 2.1.3xx marks tools ``defer_loading`` (found later by its own tool search)
    and sends ``thinking.display: "updates"``: both accepted, and a deferred tool adds no
    token to the prompt."""
    count = "/v1/messages/count_tokens"
    base = {"model": "tiny", "messages": ASK, "tools": [WEATHER],
            "thinking": {"type": "adaptive", "display": "updates"}}  # fmt: skip
    deferred = {"name": "notebook_edit", "description": "Edits a notebook cell " * 20,
                "input_schema": {"type": "object"}, "defer_loading": True}  # fmt: skip
    plain = post(url, base, path=count)
    with_deferred = post(url, {**base, "tools": [WEATHER, deferred]}, path=count)
    shown = post(url, {**base, "tools": [WEATHER, {**deferred, "defer_loading": False}]},
                 path=count)  # fmt: skip
    assert plain.status_code == with_deferred.status_code == shown.status_code == 200
    tokens = [r.json()["input_tokens"] for r in (plain, with_deferred, shown)]
    assert tokens[0] == tokens[1] < tokens[2], tokens
    r = post(url, message(tools=[WEATHER, deferred], thinking={"type": "adaptive",
                                                               "display": "updates"}))  # fmt: skip
    assert r.status_code == 200, r.text
    bad = post(url, {**base, "tools": [{**deferred, "defer_loading": "yes"}]}, path=count)
    assert bad.status_code == 400 and "defer_loading" in bad.json()["error"]["message"]
    assert_whole(url)


@pytest.mark.parametrize(
    "change, status, words",
    [
        ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, 400,
         "video"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f"}]}]}, 400,
         "messages"),
        ({"messages": ASK + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}]}, 400,
         "toolu_nope"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]}, 400, "text only"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "does not think"),
        ({"messages": ASK + [{"role": "assistant", "content": "The answer is"}]}, 400, "prefill"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, 400,
         "clear_tool_uses"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "'nope'"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"model": "claude-opus"}, 404, "claude-opus"),
        ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400, str(CONTEXT)),
        ({"output_config": {"format": {"type": "json_schema", "schema": {
            "type": "string", "pattern": "^(?!@@)"}}}}, 400, "output_config.format.schema"),
    ],
)  # fmt: skip
def test_refusals_are_anthropic_errors_and_leave_the_server_whole(url, change, status, words):
    r = post(url, {**message(), **change})
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert body["error"]["type"] == kind and words in body["error"]["message"], body
    assert_whole(url)


def test_keys_headers_and_body_limit(url):
    assert post(url, message(), headers={}).json()["error"]["type"] == "authentication_error"
    bearer = {"Authorization": f"Bearer {KEYS[1]}"}
    assert post(url, message(), headers=bearer).status_code == 200
    big = message(messages=[{"role": "user", "content": "x" * MAX_REQUEST_BYTES}])
    r = post(url, big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.get(url + "/v1/messages/nowhere", headers=HEADERS)
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert httpx.get(url + "/debug/check_integrity", headers=ADMIN).status_code == 200
