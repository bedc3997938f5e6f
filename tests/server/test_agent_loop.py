"""A three-round tool-using agent loop through the official ``openai`` client against the real
Qwen2.5-Coder-0.5B-Instruct (slow; skipped when the model is not installed): call, tool
result, call, tool result, answer; each round's prompt is served from the cache for
everything the previous rounds sent."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from radixserve.model.registry import KNOWN_MODELS, installed_path
from testing.server import running_server

QWEN_05B = KNOWN_MODELS["qwen2.5-coder-0.5b"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
            "maxLength": 30}}, "required": ["city"], "additionalProperties": False}}},
]  # fmt: skip
RESULTS = {"get_weather": '{"temperature": 14, "sky": "rain"}', "get_time": '{"time": "09:30"}'}


@pytest.fixture(scope="module")
def qwen_server():
    path = installed_path(QWEN_05B)
    if path is None:
        pytest.skip(
            f"{QWEN_05B.name} is not installed (`radixserve pull {QWEN_05B.name}` installs it "
            f"into {QWEN_05B.path.parent})"
        )
    args = ("--model", str(path), "--max-total-tokens", "8192", "--served-model-name", "qwen")
    with running_server(*args, timeout=600) as url:
        yield url


@pytest.mark.slow
def test_three_round_agent_loop_reuses_every_previous_round(qwen_server):
    client = openai.OpenAI(base_url=qwen_server + "/v1", api_key="x", max_retries=0, timeout=900)
    messages = [
        {"role": "system", "content": "You are a travel assistant. Use the tools."},
        {"role": "user", "content": "What is the weather in Oslo, and what time is it there?"},
    ]
    prompts, cached, names = [], [], []
    for round_, choice in enumerate(["required", "required", "auto"]):
        out = client.chat.completions.create(
            model="qwen", messages=messages, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=120, temperature=0,
        )  # fmt: skip
        prompts.append(out.usage.prompt_tokens)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        if round_ > 0:  # everything the previous round sent is a prefix served from the cache
            assert cached[-1] >= prompts[-2], (prompts, cached)
        msg = out.choices[0].message
        if round_ == 2:
            break
        assert out.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
        names.append(call.function.name)
        fn = {"name": call.function.name, "arguments": call.function.arguments}
        messages.append(
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": call.id, "type": "function", "function": fn}]}
        )  # fmt: skip
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": RESULTS[call.function.name]}
        )
    final = out.choices[0]
    summary = {"prompt_tokens": prompts, "cached_tokens": cached, "calls": names,
               "finish": final.finish_reason, "answer": final.message.content}  # fmt: skip
    print(json.dumps(summary))
    assert final.finish_reason in ("stop", "tool_calls")
