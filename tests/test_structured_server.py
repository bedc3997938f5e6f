"""Structured outputs over HTTP: response_format, grammar extensions, logit_bias (tiny model)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_helpers import running_server
from server_helpers import wait_idle as wait_for_idle

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
    body = {"model": "tiny", **extra}
    if path == "/v1/chat/completions":
        body["messages"] = CHAT
    elif path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body = {"text": "hi", **extra}
    r = httpx.post(server + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert_nothing_held(server)
