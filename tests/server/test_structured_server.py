"""Structured outputs over HTTP: response_format, grammar extensions, logit_bias (tiny model)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from testing.server import read_metrics, running_server
from testing.server import wait_idle as wait_for_idle

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": "Bearer admin-key"}
CHAT = [{"role": "user", "content": "Describe a colour as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}


class Colour(pydantic.BaseModel):
    colour: str = pydantic.Field(max_length=8)
    dark: bool


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = "--max-total-tokens 2048 --api-key {key} --admin-key admin-key --served-model-name tiny"
    args += " --draft-max-batch 64"  # streaming, tools and metrics with grammar drafts
    with running_server("--model", str(tiny_model_dir), *args.format(key=KEY).split()) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def assert_nothing_held(server) -> None:
    wait_for_idle(server, AUTH)
    r = httpx.get(server + "/debug/check_integrity", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text


def test_json_object_and_json_schema_outputs_parse_and_validate(client, server):
    obj = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=200, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    choice = obj.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=60, temperature=0.7, seed=1, n=2,
        response_format=fmt,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert_nothing_held(server)
    before = read_metrics(server, AUTH)
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, response_format=fmt)
    after = wait_for_idle(server, AUTH)
    assert after["constrained_requests_total"] == before["constrained_requests_total"] + 1
    assert after["grammar_cache_hits_total"] == before["grammar_cache_hits_total"] + 1
    assert after["grammar_compiles_total"] == before["grammar_compiles_total"] >= 2
    # the schema forces its first key: computed ahead as a draft (jump forward)
    proposed, accepted = (
        f"draft_{k}_tokens_total{{source=grammar}}" for k in ("proposed", "accepted")
    )
    assert after[proposed] > before[proposed]
    assert after[accepted] <= after[proposed]


def test_openai_parse_returns_the_pydantic_object(client):
    done = client.beta.chat.completions.parse(
        model="tiny", messages=CHAT, max_tokens=80, temperature=0, response_format=Colour
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Colour) and len(parsed.colour) <= 8


def test_streamed_json_schema_and_regex_extensions(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=60, temperature=0, stream=True,
        response_format=fmt,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    pattern = r"(ab|cd)[0-9]{2,4}"
    done = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=20, temperature=1.0, seed=4,
        extra_body={"regex": pattern},
    )  # fmt: skip
    assert re.fullmatch(pattern, done.choices[0].text)
    grammar = {"max_tokens": 8, "ebnf": 'root ::= "yes" | "no"', "temperature": 0}
    body = {"text": "Answer:", "stream": True, "sampling_params": grammar}
    with httpx.stream("POST", server + "/generate", json=body, headers=AUTH, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["text"] for e in events) in ("yes", "no")
    assert events[-1]["meta_info"]["finish_reason"] == "stop"
    assert_nothing_held(server)


def test_logit_bias_forces_a_token(client, server):
    r = httpx.post(server + "/generate", headers=AUTH, timeout=60,
                   json={"input_ids": [1, 2, 3], "sampling_params": {
                       "max_tokens": 3, "temperature": 0, "logit_bias": {"77": 100}}})  # fmt: skip
    assert r.json()["output_ids"] == [77, 77, 77]
    done = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=3, temperature=0, logit_bias={"77": 100}
    )
    assert done.choices[0].text == r.json()["text"]


def post_with_prompt(server: str, path: str, extra: dict, **openai: Any) -> httpx.Response:
    """POST ``extra`` to ``path`` with a short prompt in the form that endpoint takes (and
    ``openai``'s fields on the OpenAI endpoints)."""
    body = {"model": "tiny", **openai, **extra}
    if path == "/v1/chat/completions":
        body["messages"] = CHAT
    elif path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body = {"text": "hi", **extra}
    return httpx.post(server + path, json=body, headers=AUTH, timeout=30)


@pytest.mark.parametrize(
    "path, extra, words",
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "objekt",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"regex": "[a-"}, "regex"),
        ("/v1/completions", {"ebnf": "root ::= nothing"}, "nothing"),
        ("/v1/completions", {"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/generate", {"sampling_params": {"json_schema": "{bad"}}, "not valid JSON"),
    ],
)
def test_bad_grammars_and_biases_are_a_400_naming_the_problem(server, path, extra, words):
    r = post_with_prompt(server, path, extra)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert_nothing_held(server)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {  # a local $ref
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "additionalProperties": False, "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call, tools) -> None:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def test_required_and_named_tool_choices_always_give_valid_calls(client, server):
    tools = [WEATHER, TIME]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, parallel in [("required", True), ("required", False), (named, None)]:
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        out = client.chat.completions.create(
            model="tiny", messages=ASK, tools=tools, tool_choice=choice, max_tokens=120,
            temperature=0.8, seed=2, **extra,
        )  # fmt: skip
        c = out.choices[0]
        if parallel and c.finish_reason == "length":
            continue  # a random model may go on adding calls to the array: a cut-off
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert c.message.tool_calls and (parallel is not False or len(c.message.tool_calls) == 1)
        for call in c.message.tool_calls:
            check_call(call, tools)
        if isinstance(choice, dict):
            assert {call.function.name for call in c.message.tool_calls} == {"get_time"}
    assert_nothing_held(server)


def test_streamed_tool_call_deltas_and_a_tool_result_round_trip(client, server):
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120,
        temperature=0, stream=True, parallel_tool_calls=False,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    check_call(deltas[0], [WEATHER])
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": deltas[0].id, "type": "function", "function": {
                "name": "get_weather", "arguments": deltas[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": deltas[0].id, "content": '{"celsius": 21}'},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert none.choices[0].message.tool_calls is None
    assert_nothing_held(server)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "integr"}}}}}]}, "tools[0] (f)"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "'x'"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"messages": [{"role": "tool", "content": "1"}]}, "tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_tool(server, extra, words):
    body = {"model": "tiny", "messages": ASK, **extra}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert_nothing_held(server)


LOOKAHEAD = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^(?=.*a)\\w+$"}}}
NOT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "not": {"const": 3}}}}}}  # fmt: skip


@pytest.mark.parametrize(
    "path, extra, message",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": LOOKAHEAD}}},
         "response_format.json_schema.schema.properties.id.pattern: lookahead (?=...) is not "
         "supported"),
        ("/v1/completions", {"json_schema": {"allOf": [{"type": "string", "pattern": "^a"},
                                                       {"pattern": "b$", "not": {"const": "ab"}}]}},
         "json_schema.allOf[1].not: not is not supported"),
        ("/v1/completions", {"json_schema": {"allOf": [{"$ref": "#/$defs/o"}, {"properties": {
            "x": {"type": "string", "pattern": "(?=a)"}}}], "$defs": {"o": {"type": "object"}}}},
         "json_schema.allOf[1].properties.x.pattern: lookahead (?=...) is not supported"),
        ("/generate", {"sampling_params": {"json_schema": json.dumps({"type": "array",
            "items": {"type": "object", "properties": {"n": {"type": "integer"}}},
            "uniqueItems": True})}},
         "sampling_params.json_schema.uniqueItems: uniqueItems is not supported on these items "
         "(only on free strings, numbers, objects or values, records of free strings, or a "
         "few listed values)"),
        ("/v1/completions", {"regex": "a$b"},
         "regex: '$' that is not at the end of the pattern or of an alternative is not "
         "supported"),
        ("/v1/chat/completions", {"tools": [WEATHER, NOT_TOOL], "tool_choice": "required"},
         "tools[1].function.parameters.properties.x.not: not is not supported"),
        ("/v1/chat/completions", {"tools": [NOT_TOOL], "tool_choice": {
            "type": "function", "function": {"name": "f"}}},
         "tools[0].function.parameters.properties.x.not: not is not supported"),
    ],
)  # fmt: skip
def test_constructs_the_grammar_would_not_enforce_are_a_400_naming_path_and_keyword(
    server, path, extra, message
):
    r = post_with_prompt(server, path, extra, max_tokens=4)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == message and error["type"] == "invalid_request_error", error
    assert_nothing_held(server)


def test_exclusive_and_rewritten_schemas_are_accepted_and_auto_tools_keep_any_schema(
    client, server
):
    pet = {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {
            "type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "lives"],
         "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"enum": ["dog", "fox"]}},
         "required": ["kind"], "additionalProperties": False},
        {"type": "null"},
    ]}  # fmt: skip
    for seed in range(3):
        out = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=60, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": pet}},
        )  # fmt: skip
        choice = out.choices[0]
        if choice.finish_reason == "stop":  # else cut off by max_tokens: not an output
            jsonschema.validate(json.loads(choice.message.content), pet)
    # allOf, a $ref with keywords beside it and keywords beside oneOf: rewritten exactly
    base = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
            "required": ["name"]}  # fmt: skip
    merged = {
        "$defs": {"base": base, "pet": pet},
        "allOf": [
            {"$ref": "#/$defs/base"},
            {"properties": {"pet": {"$ref": "#/$defs/pet", "type": "object"}}, "required": ["pet"]},
        ],
    }
    for seed in range(2):
        out = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=80, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": merged}},
        )  # fmt: skip
        if out.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.choices[0].message.content), merged)
    # with tool_choice auto the parameters only go into the prompt: nothing is refused
    auto = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[NOT_TOOL], max_tokens=4, temperature=0
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert_nothing_held(server)


def test_constraint_checks_run_off_the_event_loop():
    """A request's grammar and tool-schema checks (a large schema takes a fraction of a second
    to seconds) run on a worker thread, and their 400 reaches the caller as raised."""
    import asyncio
    import threading

    from radixserve.api.errors import ApiError
    from radixserve.server.serving import Serving

    serving = Serving(None, None, None, None, max_running=1)

    def refuse():
        raise ApiError(400, "bad schema", "response_format")

    async def run():
        name = await serving.checked(lambda: threading.current_thread().name)
        with pytest.raises(ApiError, match="bad schema"):
            await serving.checked(refuse)
        return name

    try:
        assert asyncio.run(run()).startswith("radixserve-check")
    finally:
        serving.close()
