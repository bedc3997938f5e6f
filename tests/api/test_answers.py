"""Answers given with tools, re-sent in a history, render as the model drew them: the run of
assistant messages that says exactly what a remembered answer says becomes that answer's
tokens; other arguments, other text, another tenant, or an answer never given render as the
template does; the memory stays within its bounds."""

from __future__ import annotations

import json

from radixserve.api.answers import IDS, AnswerMemory, drawn_ids, encode_chat, restore
from radixserve.api.chat_input import ChatInput
from radixserve.api.tools import ToolPlan
from radixserve.engine.sampling_params import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
PLAN = ToolPlan.build(TOOLS, "auto", None)
# as a small model writes a call: bare JSON, its own spacing, text after it
RAW = '{"name":"read",  "arguments": {"path": "hello.py"}}\n{"note": "reading"}'
ASK = {"role": "user", "content": "What does hello.py print?"}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "print('hi')"}


def call(path: str = "hello.py") -> dict:
    args = json.dumps({"path": path})
    return {"id": "c1", "type": "function", "function": {"name": "read", "arguments": args}}


def conversation(assistant: list[dict]) -> list[dict]:
    return [ASK, *assistant, RESULT]


def remembered(memory: AnswerMemory, tenant: str | None, tokenizer) -> tuple[int, ...]:
    ids = tuple(tokenizer.encode(RAW, add_special_tokens=False))
    memory.remember(tenant, PLAN, RAW, ids)
    return ids


def prompt_ids(messages: list[dict], memory: AnswerMemory, tokenizer) -> list[int]:
    chat = ChatInput.build(messages, PLAN, None, [SamplingParams()])
    return encode_chat(tokenizer, *chat.render(tokenizer.template_has_tools, memory.recall("a")))


def test_an_answer_resent_in_any_apis_shape_becomes_its_tokens(default_tokenizer):
    memory = AnswerMemory()
    ids = remembered(memory, "a", default_tokenizer)
    text = '{"note": "reading"}'
    shapes = {  # chat completions (one message), Responses (a call item, then a message item)
        "one": [{"role": "assistant", "content": text, "tool_calls": [call()]}],
        "split": [{"role": "assistant", "content": "", "tool_calls": [call()]},
                  {"role": "assistant", "content": text}],
    }  # fmt: skip
    for shape in shapes.values():
        out = restore(conversation(shape), memory.recall("a"))
        assert out == [ASK, {"role": "assistant", "content": RAW, IDS: ids}, RESULT]
        prompt = prompt_ids(conversation(shape), memory, default_tokenizer)
        head = prompt_ids([ASK], memory, default_tokenizer)  # the prompt that was answered
        assert prompt[: len(head) + len(ids)] == head + list(ids)


def test_anything_but_the_same_answer_of_the_same_tenant_renders_as_sent(default_tokenizer):
    memory = AnswerMemory()
    remembered(memory, "a", default_tokenizer)
    text = '{"note": "reading"}'
    others = [
        [{"role": "assistant", "content": text, "tool_calls": [call("other.py")]}],
        [{"role": "assistant", "content": text + " more", "tool_calls": [call()]}],
        [{"role": "assistant", "content": "", "tool_calls": [call()]}],
    ]
    for assistant in others:
        assert restore(conversation(assistant), memory.recall("a")) == conversation(assistant)
    same = conversation([{"role": "assistant", "content": text, "tool_calls": [call()]}])
    assert restore(same, memory.recall("b")) == same  # another tenant's
    assert restore(same, AnswerMemory().recall("a")) == same  # never given


def test_tokens_that_spell_more_than_the_text_are_not_kept(default_tokenizer):
    ids = default_tokenizer.encode("Hello there, friend", add_special_tokens=False)
    eos = default_tokenizer.eos_token_ids[0]
    text = default_tokenizer.decode(ids)
    assert drawn_ids(default_tokenizer, [*ids, eos], text) == tuple(ids)
    assert drawn_ids(default_tokenizer, ids, "Hello there") is None  # cut at a stop string


def test_the_memory_keeps_the_latest_answers_of_the_latest_tenants():
    memory = AnswerMemory(per_tenant=2, tenants=2)
    for i in range(3):
        memory.remember("a", PLAN, f"answer {i}", None)
    for tenant in ("b", "c"):
        memory.remember(tenant, PLAN, "answer 2", None)
    said = [{"role": "assistant", "content": f"answer {i}"} for i in range(3)]
    kept = [restore([m], memory.recall("c"))[0].get(IDS, "as sent") for m in said]
    assert kept == ["as sent", "as sent", None]  # c's one answer, restored (no tokens kept)
    assert restore([said[2]], memory.recall("a")) == [said[2]]  # a was dropped (3 tenants)
    memory.remember("b", PLAN, "answer 0", None)
    memory.remember("b", PLAN, "answer 1", None)
    assert [restore([m], memory.recall("b"))[0].get(IDS, 0) for m in said] == [None, None, 0]


def test_text_around_a_call_is_matched_as_the_messages_api_joins_its_blocks():
    memory = AnswerMemory()
    raw = 'Let me look. <tool_call>{"name": "read", "arguments": {"path": "a"}}</tool_call> Then <'
    memory.remember(None, PLAN, raw, None)
    blocks = {"role": "assistant", "content": "Let me look.\n\nThen <", "tool_calls": [call("a")]}
    assert restore([blocks], memory.recall(None))[0]["content"] == raw
