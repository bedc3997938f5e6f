"""Structured output over HTTP on the default model (SmolLM2-135M) with both grammar
backends: a schema only llguidance enforces is enforced end to end and counted under its
backend in /metrics; what neither enforces is a 400 in the OpenAI error shape naming the
construct, whatever the schema's own llguidance options say."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from testing.grammar_walk import LLGUIDANCE_ONLY
from testing.server import running_server
from testing.server import wait_idle as wait_for_idle

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": "Bearer admin-key"}
# distinct items the tracker cannot keep distinct (objects with an integer property)
TAGS = {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}}},
        "uniqueItems": True}  # fmt: skip
UNIQUE = (
    "uniqueItems is not supported on these items (only on free strings, numbers, objects "
    "or values, records of free strings, or a few listed values)"
)


@pytest.fixture(scope="module")
def server():
    args = f"--max-total-tokens 2048 --api-key {KEY} --admin-key admin-key --served-model-name m"
    with running_server(*args.split(), "--draft-max-batch", "4") as url:
        yield url


def backend_requests(server: str) -> dict[str, float]:
    text = httpx.get(server + "/metrics", headers=AUTH, timeout=30).text
    found = re.findall(r'grammar_backend_requests_total\{backend="(\w+)"[^}]*\} ([\d.]+)', text)
    return {name: float(value) for name, value in found}


def test_a_schema_only_llguidance_enforces_is_enforced_and_counted(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)
    before = backend_requests(server)
    outputs = []
    for who in ("Ada",):
        out = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Sign up {who} as JSON."}],
            max_tokens=120, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "s", "schema": LLGUIDANCE_ONLY}},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        outputs.append(json.loads(choice.message.content))
    for value in outputs:
        jsonschema.validate(value, LLGUIDANCE_ONLY)
        assert len(value["repository_name"]) <= 16 and len(value["contact_email_address"]) <= 30
    after = wait_and_count(server)
    assert after["llguidance"] == before["llguidance"] + 1
    assert after["xgrammar"] == before["xgrammar"]


def wait_and_count(server: str) -> dict[str, float]:
    wait_for_idle(server, AUTH)
    return backend_requests(server)


@pytest.mark.parametrize(
    "path, extra, message",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "t", "schema": {"type": "object", "properties": {"tags": TAGS}}}}},
         f"response_format.json_schema.schema.properties.tags.uniqueItems: {UNIQUE}"),
        ("/v1/completions", {"json_schema": {"x-guidance": {"lenient": True}, **TAGS}},
         f"json_schema.uniqueItems: {UNIQUE}"),
        ("/v1/completions", {"json_schema": {"type": "object", "if": {"required": ["a"]},
                                             "then": {"required": ["b"]}}},
         "json_schema.if: if is not supported"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                "id": {"type": "string", "pattern": "^(?!.*x)\\w+$"}}}}}],
            "tool_choice": "required"},
         "tools[0].function.parameters.properties.id.pattern: negative lookahead (?!...) is not "
         "supported"),
    ],
)  # fmt: skip
def test_what_neither_backend_enforces_is_a_400_naming_the_construct(server, path, extra,
                                                                      message):  # fmt: skip
    body = {"model": "m", "max_tokens": 4, **extra}
    if path == "/v1/completions":
        body["prompt"] = "JSON:"
    else:
        body["messages"] = [{"role": "user", "content": "JSON please"}]
    r = httpx.post(server + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == message and error["type"] == "invalid_request_error", error
    wait_for_idle(server, AUTH)
    r = httpx.get(server + "/debug/check_integrity", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
