"""A three-round tool-using agent loop through the official ``openai`` client against the real
Qwen2.5-Coder-0.5B-Instruct (slow; skipped when the model is not installed): call, tool
result, call, tool result, answer; each round's prompt is served from the cache for
everything the previous rounds sent and answered."""

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
    prompts, cached, names, drawn = [], [], [], []
    for round_, choice in enumerate(["required", "required", "auto"]):
        out = client.chat.completions.create(
            model="qwen", messages=messages, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=120, temperature=0,
        )  # fmt: skip
        prompts.append(out.usage.prompt_tokens)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        if round_ > 0:  # the previous round's prompt and answer (the call, as the model wrote
            # it, all but its last token) are a prefix served from the cache
            assert cached[-1] >= prompts[-2] + drawn[-1] - 1, (prompts, cached, drawn)
        drawn.append(out.usage.completion_tokens)
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


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
QUESTION = "What is the weather in Oslo, and what time is it there?"
MAX_ROUNDS = 5


@pytest.mark.slow
def test_anthropic_sdk_tool_loop_streams_and_ends_with_an_answer(qwen_server):
    """Claude-style: streamed messages with tools through the ``anthropic`` client; a call is
    forced in the first round, then the model chooses, and a last round (``none``) asks for
    the answer, as agents do at their limit; the session ends with text that is not a call,
    every round's prompt served from the cache up to what the previous round sent."""
    import anthropic

    client = anthropic.Anthropic(base_url=qwen_server, api_key="x", max_retries=0, timeout=900)
    messages = [{"role": "user", "content": QUESTION}]
    prompts, cached, calls = [], [], []
    for round_ in range(MAX_ROUNDS):
        # a call forced first, then the model's choice; the last round asks for the answer
        choice = ({"type": "any", "disable_parallel_tool_use": True} if round_ == 0 else
                  {"type": "none"} if round_ == MAX_ROUNDS - 1 else None)  # fmt: skip
        with client.messages.stream(
            model="qwen", max_tokens=200, system="You are a travel assistant. Use the tools.",
            messages=messages, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0},
            **({"tool_choice": choice} if choice else {}),
        ) as stream:  # fmt: skip
            kinds = {event.type for event in stream}
            out = stream.get_final_message()
        assert {"message_start", "message_stop", "content_block_stop"} <= kinds
        u = out.usage
        prompts.append(u.input_tokens + u.cache_read_input_tokens)
        cached.append(u.cache_read_input_tokens)
        if round_ > 0:
            assert cached[-1] >= prompts[-2], (prompts, cached)
        if out.stop_reason != "tool_use":
            break
        uses = [b for b in out.content if b.type == "tool_use"]
        calls += [b.name for b in uses]
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                           for b in out.content]})  # fmt: skip
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": RESULTS[b.name]}
            for b in uses]})  # fmt: skip
    counted = client.messages.count_tokens(
        model="qwen",
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        system="You are a travel assistant. Use the tools.",
    )
    assert counted.input_tokens == prompts[-1]
    text = "".join(b.text for b in out.content if b.type == "text")
    rounds = len(prompts)
    print(json.dumps({"prompts": prompts, "cached": cached, "calls": calls, "answer": text,
                      "rounds": rounds}))  # fmt: skip
    assert calls and out.stop_reason == "end_turn" and text.strip()
    assert "<tool_call>" not in text and '"arguments"' not in text


@pytest.mark.slow
def test_openai_sdk_responses_tool_loop_with_previous_response_id(qwen_server):
    """Codex-style: streamed ``responses.create`` with function tools, each round continuing
    the last with ``previous_response_id`` and sending only the function outputs."""
    client = openai.OpenAI(base_url=qwen_server + "/v1", api_key="x", max_retries=0, timeout=900)
    new_input: list | str = QUESTION
    previous, prompts, cached, calls = None, [], [], []
    for round_ in range(MAX_ROUNDS):
        stream = client.responses.create(
            model="qwen", input=new_input, previous_response_id=previous,
            instructions="You are a travel assistant. Use the tools.", tools=RESPONSES_TOOLS,
            tool_choice=("required", "auto", "auto", "auto", "none")[round_],
            parallel_tool_calls=False,
            max_output_tokens=200, temperature=0, stream=True,
        )  # fmt: skip
        events = list(stream)
        seq = [e.sequence_number for e in events]
        assert seq == list(range(len(seq))) and events[-1].type == "response.completed"
        response = events[-1].response
        prompts.append(response.usage.input_tokens)
        cached.append(response.usage.input_tokens_details.cached_tokens)
        if round_ > 0:
            assert cached[-1] >= prompts[-2], (prompts, cached)
        fcalls = [item for item in response.output if item.type == "function_call"]
        if not fcalls:
            break
        calls += [c.name for c in fcalls]
        previous = response.id
        new_input = [{"type": "function_call_output", "call_id": c.call_id,
                      "output": RESULTS[c.name]} for c in fcalls]  # fmt: skip
    print(json.dumps({"prompts": prompts, "cached": cached, "calls": calls,
                      "answer": response.output_text}))  # fmt: skip
    assert calls and response.output_text.strip() and not fcalls
    assert "<tool_call>" not in response.output_text and '"arguments"' not in response.output_text
