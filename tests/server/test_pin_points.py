"""Where cache points end in the prompt (``chat_run.pin_ends``), on the default model's chat
template: each point ends exactly where its message's turn ends in the prompt the request
renders, with tools (listed in a system turn of their own when the template has no tools
argument) and without a system prompt."""

from __future__ import annotations

from radixserve.api.anthropic import MessagesRequest
from radixserve.server.chat_run import pin_ends

TOOL = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        "cache_control": {"type": "ephemeral", "ttl": "1h"}}  # fmt: skip


def prompt_and_ends(tokenizer, body):
    chat = MessagesRequest.model_validate(body).to_chat_input({})
    messages, tools = chat.render(tokenizer.template_has_tools)
    ids = tokenizer.encode_chat(messages, tools)
    return ids, messages, pin_ends(tokenizer, chat, ids)


def turn_end(tokenizer, messages, n) -> int:
    text = tokenizer.render_chat(messages[:n], add_generation_prompt=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_points_end_where_their_turns_end(default_tokenizer):
    body = {"model": "m", "max_tokens": 4, "tools": [TOOL],
            "system": [{"type": "text", "text": "You are terse.",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Read a.txt",
                          "cache_control": {"type": "ephemeral"}}]}]}  # fmt: skip
    ids, messages, ends = prompt_and_ends(default_tokenizer, body)
    system_end = turn_end(default_tokenizer, messages, 1)
    assert ends == ((system_end, 3600.0), (turn_end(default_tokenizer, messages, 2), 300.0))
    assert 0 < system_end < ends[1][0] < len(ids)


def test_a_tool_point_without_a_system_prompt_covers_the_tool_listing(default_tokenizer):
    body = {"model": "m", "max_tokens": 4, "tools": [TOOL],
            "messages": [{"role": "user", "content": "Read a.txt"}]}  # fmt: skip
    ids, messages, ends = prompt_and_ends(default_tokenizer, body)
    assert messages[0]["role"] == "system" and "read_file" in messages[0]["content"]
    ((end, ttl),) = ends
    assert ttl == 3600.0 and end == turn_end(default_tokenizer, messages, 2) < len(ids)
