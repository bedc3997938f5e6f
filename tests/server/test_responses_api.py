"""The OpenAI Responses API against a real server (tiny model): the stream's events and
sequence numbers add up to the whole response, function calls (namespaced too) and their
outputs, previous_response_id served from the cache, the store's tenants and bounds, and
every refusal in OpenAI's error shape; the server is whole after each."""

from __future__ import annotations

import httpx
import openai
import pytest

from testing.agents import CONTEXT, KEYS, assert_whole, sse_events

A, B = ({"Authorization": f"Bearer {k}"} for k in KEYS)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
            "maxLength": 20}}, "required": ["city"], "additionalProperties": False}}  # fmt: skip
SPACE = {"type": "namespace", "name": "travel", "description": "Travel tools",
         "tools": [{**WEATHER, "name": "get_time"}]}  # fmt: skip


@pytest.fixture
def url(agent_url):  # one server for this module and the other agent API's (conftest.py)
    return agent_url


def post(url, body, headers=A):
    return httpx.post(url + "/v1/responses", json=body, headers=headers, timeout=60)


def ask(**extra):
    return {"model": "tiny", "input": "Weather in Oslo?", "max_output_tokens": 10,
            "temperature": 0, **extra}  # fmt: skip


def test_stream_events_add_up_to_the_whole_response(url):
    whole = post(url, ask()).json()
    assert whole["status"] == "incomplete" and whole["object"] == "response"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    events = sse_events(post(url, ask(stream=True)).text)
    names = [n for n, _ in events]
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text == whole["output"][0]["content"][0][
        "text"]  # fmt: skip
    prompt = whole["usage"]["input_tokens"]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == prompt - 1
    # the opening events, sent once the request was admitted, already say what was cached
    for _, opening in events[:2]:
        assert opening["response"]["usage"]["input_tokens_details"]["cached_tokens"] == prompt - 1
    assert_whole(url)


def test_function_calls_and_previous_response_id_with_the_sdk(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[0], max_retries=0)
    first = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=60, temperature=0)  # fmt: skip
    call = first.output[0]
    assert first.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}],
    )  # fmt: skip
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(second.id).id == second.id
    stream = client.responses.create(model="tiny", input="Time in Oslo?", tools=[SPACE],
                                     tool_choice={"type": "function", "name": "get_time"},
                                     max_output_tokens=60, stream=True)  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-1] == "response.completed"
    item = events[-1].response.output[0]
    assert item.name == "get_time" and item.namespace == "travel"
    assert_whole(url)


def test_the_store_keeps_tenants_apart_and_is_bounded(url):
    kept = post(url, ask()).json()["id"]
    assert httpx.get(f"{url}/v1/responses/{kept}", headers=A).status_code == 200
    for headers, body in [(B, ask(previous_response_id=kept)), (A, ask(previous_response_id="x"))]:
        r = post(url, body, headers)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{url}/v1/responses/{kept}", headers=B).status_code == 404
    unstored = post(url, ask(store=False)).json()["id"]
    assert httpx.get(f"{url}/v1/responses/{unstored}", headers=A).status_code == 404
    for _ in range(4):  # --stored-responses 4: the oldest goes
        post(url, ask())
    assert httpx.get(f"{url}/v1/responses/{kept}", headers=A).status_code == 404
    last = post(url, ask()).json()["id"]
    assert httpx.delete(f"{url}/v1/responses/{last}", headers=A).json()["deleted"] is True
    assert httpx.get(f"{url}/v1/responses/{last}", headers=A).status_code == 404
    assert_whole(url)


def test_a_codex_shaped_request_is_served(url):
    """The fields Codex sends, in its shape (our own text): developer messages, store off,
    reasoning and its include, client metadata, a cache key, and function, namespace and
    hosted tools (the hosted one left out, with a warning), an output given unasked."""
    body = {
        "model": "tiny", "stream": True, "store": False, "tool_choice": "auto",
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1",
        "client_metadata": {"session_id": "session-1"}, "instructions": "",
        "tools": [WEATHER, SPACE, {"type": "web_search", "external_web_access": False}],
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "You are a coding agent."}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "List the files."}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_time",
             "arguments": "{\"city\": \"Oslo\"}", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "09:30"},
            # an output no call asked for, as Codex gives its goal after setting one
            {"type": "function_call_output", "name": "goal_objective", "namespace": "agent",
             "output": "List the files."},
        ],
        "max_output_tokens": 30,
    }  # fmt: skip
    r = post(url, body)
    assert r.status_code == 200, r.text
    assert "web_search" in r.headers["x-radixserve-warning"]
    assert sse_events(r.text)[-1][0] in ("response.completed", "response.incomplete")
    assert_whole(url)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "text only"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]},
         "call_nope"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "not JSON"),
        ({"tools": [WEATHER, WEATHER]}, "more than once"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "word " * 3000}, str(CONTEXT)),
        ({"input": []}, "input"),
    ],
)  # fmt: skip
def test_refusals_are_openai_errors_and_leave_the_server_whole(url, change, words):
    r = post(url, {**ask(), **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
    assert_whole(url)
