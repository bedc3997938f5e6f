"""Reading an agent's recorded exchanges: the APIs' streams checked for their order, usage
and cached tokens read per request, TTFT from the event that carried the first output."""

from __future__ import annotations

import json

from radixserve.bench.agent_proxy import Exchange
from radixserve.bench.agent_transcript import (
    api_of,
    cache_rows,
    model_turns,
    problems,
    read_turns,
    save_transcript,
)

SSE = {"content-type": "text/event-stream; charset=utf-8"}
JSON = {"content-type": "application/json"}


def named(kind: str, **data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def unnamed(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def exchange(path: str, chunks: list[bytes], headers=SSE, status=200, start=100.0) -> Exchange:
    ex = Exchange("POST", path, {}, b"{}", start, status, dict(headers))
    ex.chunks = [(start + 1.0 + i, c) for i, c in enumerate(chunks)]
    ex.end = start + 1.0 + len(chunks)
    return ex


def message_stream(blocks: list[bytes], usage=None, stop="end_turn") -> list[bytes]:
    usage = usage or {"input_tokens": 100, "cache_read_input_tokens": 900, "output_tokens": 5,
                      "cache_creation_input_tokens": 0}  # fmt: skip
    start = {"id": "m", "type": "message", "role": "assistant", "content": [],
             "usage": {"input_tokens": 100, "output_tokens": 0}}  # fmt: skip
    delta = {"stop_reason": stop, "stop_sequence": None}
    return [named("message_start", message=start), named("ping"), *blocks,
            named("message_delta", delta=delta, usage=usage), named("message_stop")]  # fmt: skip


TEXT_BLOCK = [
    named("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    named("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hello"}),
    named("content_block_stop", index=0),
]
TOOL_BLOCK = [
    named("content_block_start", index=1,
          content_block={"type": "tool_use", "id": "t1", "name": "Read", "input": {}}),
    named("content_block_delta", index=1,
          delta={"type": "input_json_delta", "partial_json": '{"file_path": "a.py"}'}),
    named("content_block_stop", index=1),
]  # fmt: skip


def test_a_messages_stream_gives_text_calls_usage_and_ttft():
    ex = exchange(
        "/v1/messages?beta=true", message_stream(TEXT_BLOCK + TOOL_BLOCK, stop="tool_use")
    )
    [turn] = read_turns([ex])
    assert turn.api == "messages" and turn.streamed and turn.problems == []
    assert (turn.text, turn.tool_calls, turn.stop) == ("Hello", ["Read"], "tool_use")
    assert (turn.prompt_tokens, turn.cached_tokens, turn.output_tokens) == (1000, 900, 5)
    assert turn.cached_share == 0.9
    assert turn.ttft_s == 4.0  # the text delta is the 4th chunk, one second apart from 1.0
    assert turn.e2e_s == 1.0 + len(ex.chunks)


def test_a_messages_stream_out_of_order_is_a_problem():
    unclosed = TEXT_BLOCK[:2] + TOOL_BLOCK  # block 0 never stops before block 1 starts
    [turn] = read_turns([exchange("/v1/messages", message_stream(unclosed))])
    assert any("starts out of order" in p for p in turn.problems)
    wrong_kind = [TEXT_BLOCK[0], TOOL_BLOCK[1].replace(b'"index": 1', b'"index": 0'),
                  TEXT_BLOCK[2]]  # fmt: skip
    [turn] = read_turns([exchange("/v1/messages", message_stream(wrong_kind))])
    assert any("input_json_delta in a text block" in p for p in turn.problems)
    cut = message_stream(TEXT_BLOCK)[:-2]
    [turn] = read_turns([exchange("/v1/messages", cut)])
    assert any("message_stop" in p for p in turn.problems)
    assert any("0 message_delta" in p for p in turn.problems)
    bad_json = [TOOL_BLOCK[0].replace(b'"index": 1', b'"index": 0'),
                named("content_block_delta", index=0,
                      delta={"type": "input_json_delta", "partial_json": '{"file'}),
                named("content_block_stop", index=0)]  # fmt: skip
    [turn] = read_turns([exchange("/v1/messages", message_stream(bad_json))])
    assert any("not a JSON object" in p for p in turn.problems)


def test_an_error_event_a_cut_event_and_an_http_error_are_problems():
    errored = message_stream(TEXT_BLOCK)[:3] + [named("error", error={"message": "boom"})]
    [turn] = read_turns([exchange("/v1/messages", errored)])
    assert any("boom" in p for p in turn.problems)
    cut = message_stream(TEXT_BLOCK)
    cut[-1] = cut[-1][:-1]  # the last event's blank line is missing
    [turn] = read_turns([exchange("/v1/messages", cut)])
    assert any("ends inside an event" in p for p in turn.problems)
    body = json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                  "message": "too long"}}).encode()  # fmt: skip
    [turn] = read_turns([exchange("/v1/messages", [body], headers=JSON, status=400)])
    assert turn.status == 400 and turn.error == "too long" and turn.problems


def test_a_client_hanging_up_after_the_final_event_is_no_problem_but_before_it_is():
    whole = exchange("/v1/responses", responses_stream())
    whole.error = "stream cut: CancelledError()"
    [turn] = read_turns([whole])
    assert turn.problems == [] and turn.stop == "completed"
    short = exchange("/v1/responses", responses_stream()[:-1])
    short.error = "stream cut: CancelledError()"
    [turn] = read_turns([short])
    assert any("stream cut" in p for p in turn.problems)
    assert any("not a final event" in p for p in turn.problems)


def test_llamacpp_timings_stand_in_for_missing_cached_tokens():
    usage = {"input_tokens": 700, "output_tokens": 3}
    stream = message_stream(TEXT_BLOCK, usage=usage)
    stream[-2] = named("message_delta", delta={"stop_reason": "end_turn"}, usage=usage,
                       timings={"cache_n": 650, "prompt_n": 50})  # fmt: skip
    [turn] = read_turns([exchange("/v1/messages", stream)])
    assert (turn.prompt_tokens, turn.cached_tokens) == (700, 650) and not turn.problems


def response_event(kind: str, seq: int, **data) -> bytes:
    return named(kind, sequence_number=seq, **data)


def responses_stream(seqs=range(9)) -> list[bytes]:
    s = iter(seqs)
    resp = {"id": "r", "object": "response", "status": "completed", "output": [],
            "usage": {"input_tokens": 2000, "output_tokens": 9,
                      "input_tokens_details": {"cached_tokens": 1950}}}  # fmt: skip
    call = {"type": "function_call", "name": "shell", "arguments": '{"cmd": ["ls"]}'}
    return [
        response_event("response.created", next(s), response={**resp, "status": "in_progress"}),
        response_event("response.output_item.added", next(s), output_index=0,
                       item={"type": "message", "content": []}),
        response_event("response.output_text.delta", next(s), output_index=0, delta="Let"),
        response_event("response.output_text.delta", next(s), output_index=0, delta=" me"),
        response_event("response.output_item.done", next(s), output_index=0,
                       item={"type": "message"}),
        response_event("response.output_item.added", next(s), output_index=1,
                       item={**call, "arguments": ""}),
        response_event("response.function_call_arguments.delta", next(s), output_index=1,
                       delta=call["arguments"]),
        response_event("response.output_item.done", next(s), output_index=1, item=call),
        response_event("response.completed", next(s), response=resp),
    ]  # fmt: skip


def test_a_responses_stream_gives_text_calls_and_cached_tokens():
    [turn] = read_turns([exchange("/v1/responses", responses_stream())])
    assert turn.api == "responses" and turn.problems == []
    assert (turn.text, turn.tool_calls, turn.stop) == ("Let me", ["shell"], "completed")
    assert (turn.prompt_tokens, turn.cached_tokens) == (2000, 1950)
    assert turn.ttft_s == 3.0


def test_a_responses_stream_with_a_repeated_sequence_number_is_a_problem():
    [turn] = read_turns([exchange("/v1/responses", responses_stream([0, 1, 2, 2, 4, 5, 6, 7, 8]))])
    assert any("sequence_number 2 after 2" in p for p in turn.problems)
    cut = responses_stream()[:-1]
    [turn] = read_turns([exchange("/v1/responses", cut)])
    assert any("not a final event" in p for p in turn.problems)


def test_a_chat_stream_and_a_chat_body():
    chunks = [
        unnamed({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {
            "role": "assistant", "content": "Hi"}}]}),
        unnamed({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {
            "tool_calls": [{"index": 0, "function": {"name": "bash", "arguments": "{}"}}]},
            "finish_reason": "tool_calls"}]}),
        unnamed({"object": "chat.completion.chunk", "choices": [], "usage": {
            "prompt_tokens": 50, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 48}}}),
        unnamed("[DONE]"),
    ]  # fmt: skip
    [turn] = read_turns([exchange("/v1/chat/completions", chunks)])
    assert turn.problems == [] and (turn.text, turn.tool_calls) == ("Hi", ["bash"])
    assert (turn.prompt_tokens, turn.cached_tokens, turn.stop) == (50, 48, "tool_calls")
    body = {"object": "chat.completion", "choices": [{"message": {"content": "ok"},
            "finish_reason": "stop"}], "usage": {"prompt_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip
    [turn] = read_turns([exchange("/v1/chat/completions", [json.dumps(body).encode()], JSON)])
    assert turn.problems == [] and not turn.streamed and turn.ttft_s == 1.0
    assert (turn.text, turn.prompt_tokens, turn.cached_tokens) == ("ok", 10, 0)
    [turn] = read_turns([exchange("/v1/chat/completions", chunks[:-1])])
    assert any("[DONE]" in p for p in turn.problems)


def test_only_model_turns_count_and_the_transcript_is_saved(tmp_path):
    count = exchange("/v1/messages/count_tokens", [b'{"input_tokens": 12}'], JSON)
    models = Exchange("GET", "/v1/models", {}, b"", 99.0, 200, dict(JSON))
    chat = exchange("/v1/messages", message_stream(TEXT_BLOCK))
    turns = read_turns([models, count, chat])
    assert [t.api for t in turns] == ["other", "count_tokens", "messages"]
    assert turns[1].prompt_tokens == 12 and problems(turns) == []
    assert [t.index for t in model_turns(turns)] == [2]
    [row] = cache_rows(turns)
    assert (row["prompt"], row["cached"], row["share"]) == (1000, 900, 0.9)
    path = save_transcript([models, count, chat], tmp_path / "t.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["path"] for x in lines] == ["/v1/models", "/v1/messages/count_tokens",
                                          "/v1/messages"]  # fmt: skip
    assert "message_stop" in lines[2]["response"] and lines[0]["start_s"] == 0.0


def test_api_of_reads_the_path_without_its_query():
    assert api_of("POST", "/v1/messages?beta=true") == "messages"
    assert api_of("POST", "/v1/responses") == "responses"
    assert api_of("GET", "/v1/responses") == "other"
    assert api_of("POST", "/v1/embeddings") == "other"
