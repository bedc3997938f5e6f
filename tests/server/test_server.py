"""A real server on loopback (tiny model, separate engine process), driven over HTTP."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from testing.server import read_metrics, running_server
from testing.server import wait_idle as wait_for_idle

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def step_trace(tmp_path_factory):
    """The server's step trace: what each engine step computed, one JSON line per step."""
    return tmp_path_factory.mktemp("trace") / "steps.jsonl"


@pytest.fixture(scope="module")
def server(tiny_model_dir, step_trace):
    # float32: greedy outputs must not depend on whether the prefix came from the cache
    args = "--max-total-tokens 1024 --api-key {key} --admin-key admin-key --served-model-name tiny "
    args += f"--chunked-prefill-size 128 --dtype float32 --step-trace {step_trace}"
    with running_server("--model", str(tiny_model_dir), *args.format(key=KEY).split()) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    return read_metrics(server, AUTH)


def assert_healthy(server) -> None:
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    r = httpx.get(server + "/debug/check_integrity", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text


def wait_idle(server, timeout: float = 30) -> dict[str, float]:
    return wait_for_idle(server, AUTH, timeout)


CHAT = [{"role": "user", "content": "Tell me about radix trees."}]


def test_chat_completion_and_second_turn_hits_the_cache(client, server):
    first = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0
    )
    msg = first.choices[0].message
    assert msg.role == "assistant" and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.completion_tokens <= 12 and first.usage.prompt_tokens > 20
    history = CHAT + [
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": "And tries?"},
    ]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=5)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens <= 10
    plain = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=10, temperature=0
    )
    assert plain.choices[0].message.content == text
    assert plain.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completions_streaming_and_not(client):
    out = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 8
    assert len(choice.logprobs.tokens) == 8 and all(
        lp <= 0 for lp in choice.logprobs.token_logprobs
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
    )
    assert streamed == choice.text
    multi = client.completions.create(
        model="tiny", prompt=["a b c", "d e f"], n=2, max_tokens=3, seed=3
    )
    assert len(multi.choices) == 4 and [c.index for c in multi.choices] == [0, 1, 2, 3]


def test_concurrent_requests_are_batched(client, server, step_trace):
    def one(i):
        return client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"Question number {i}?"}],
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    one(-1)  # caches the chat template's system prompt, which all eight share
    seen = step_trace.stat().st_size
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(r.usage.completion_tokens == 16 for r in results)
    assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in results)
    # batched: several of the eight requests were computed together in one engine step
    lines = step_trace.read_bytes()[seen:].decode().splitlines()
    steps = [json.loads(line) for line in lines if line.startswith('{"step"')]
    widest = max(len(s["decodes"]) + len(s["prefills"]) for s in steps)
    assert widest >= 4, widest
    assert_healthy(server)


def test_metrics_parse_and_hit_counters_move(client, server):
    before = metrics(server)
    prompt = [{"role": "user", "content": "A question asked twice, word for word."}]
    client.chat.completions.create(model="tiny", messages=prompt, max_tokens=2)
    middle = metrics(server)
    client.chat.completions.create(model="tiny", messages=prompt, max_tokens=2)
    after = metrics(server)
    prompt_len = after["radix_cache_query_tokens_total"] - middle["radix_cache_query_tokens_total"]
    assert prompt_len > 10
    assert middle["radix_cache_query_tokens_total"] > before["radix_cache_query_tokens_total"]
    hits = after["radix_cache_hit_tokens_total"] - middle["radix_cache_hit_tokens_total"]
    assert hits == prompt_len - 1
    assert after["prompt_tokens_total"] - middle["prompt_tokens_total"] == prompt_len
    # a latency histogram has no samples before its first request: count those as 0
    ttft = "time_to_first_token_seconds_count"
    assert after[ttft] > before.get(ttft, 0)
    e2e = "e2e_request_latency_seconds_count"
    assert after[e2e] == middle[e2e] + 1
    assert after["generation_tokens_total"] > middle["generation_tokens_total"]
    assert 0 < after["radix_cache_hit_rate"] <= 1 and after["kv_cache_capacity_tokens"] == 1024
    for name in (
        "radix_evicted_tokens_total",
        "radix_avg_prefix_match_len",
        "kv_cache_usage_ratio",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "radix_evict_count_per_batch_count",
        "generation_tokens_total",
    ):
        assert name in after


def post(server, path, body, headers=AUTH):
    return httpx.post(
        server + path,
        content=body if isinstance(body, str) else json.dumps(body),
        headers={**headers, "Content-Type": "application/json"},
        timeout=60,
    )


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ('{"model": "tiny", "messages": [', 400, "not valid JSON"),
        ({"model": "tiny", "messages": CHAT, "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "tiny", "messages": []}, 400, "messages must not be empty"),
        ({"model": "tiny", "messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0]"),
        ({"model": "tiny", "messages": CHAT, "frobnicate": 1}, 400, "'frobnicate'"),
        ({"model": "tiny", "messages": CHAT, "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "messages": CHAT, "n": 0}, 400, "n must be"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        ({"model": "gpt-9", "messages": CHAT}, 404, "'gpt-9' not found"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "word " * 2100}]},
            400,
            "context is 2048",
        ),
        ({"model": "tiny", "messages": CHAT, "max_tokens": 1500}, 400, "KV pool holds only 1024"),
        ({"model": "tiny", "messages": CHAT, "max_tokens": 2100}, 400, "context of 2048"),
        (  # within the context, larger than the whole pool
            {"model": "tiny", "messages": [{"role": "user", "content": "word " * 1100}]},
            400,
            "KV pool holds only 1024",
        ),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_survives(server, body, status, needle):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"]
    assert_healthy(server)


def test_api_key_is_required_except_for_health(server):
    assert httpx.get(server + "/health").status_code == 200
    r = httpx.get(server + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(server + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    assert httpx.get(server + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"


def test_disconnected_stream_releases_its_slots(server):
    body = {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": 600,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up mid-stream
    m = wait_idle(server)
    assert m["kv_cache_used_tokens"] == m["radix_cache_cached_tokens"]  # nothing held
    assert_healthy(server)


def test_generate_flush_and_cache_summary(server):
    ids = list(range(1000, 1040))
    first = post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 4}})
    assert first.status_code == 200
    out = first.json()
    assert len(out["output_ids"]) == 4 and out["meta_info"]["prompt_tokens"] == 40
    again = post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 4}})
    assert again.json()["meta_info"]["cached_tokens"] == 39
    assert httpx.get(server + "/cache", headers=AUTH).status_code == 403  # admin only
    summary = httpx.get(server + "/cache", headers=ADMIN).json()
    assert summary["cached_tokens"] > 0 and summary["num_nodes"] > 0
    assert any(p["prefix_tokens"] >= 39 for p in summary["top_prefixes"])
    assert post(server, "/flush_cache", {}).status_code == 403
    flushed = post(server, "/flush_cache", {}, headers=ADMIN).json()["flushed_tokens"]
    assert flushed > 0 and metrics(server)["radix_cache_cached_tokens"] == 0
    after = post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 4}})
    assert after.json()["meta_info"]["cached_tokens"] == 0
    bad = post(server, "/generate", {"input_ids": ids, "sampling_params": {"top_q": 1}})
    assert bad.status_code == 400 and "top_q" in bad.json()["error"]["message"]


def test_stop_strings_and_n_through_the_api(client):
    full = client.completions.create(
        model="tiny",
        prompt="The rain in Spain",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = full.choices[0].text
    stop = text[5:8]
    cut = client.completions.create(
        model="tiny",
        prompt="The rain in Spain",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    many = client.chat.completions.create(
        model="tiny", messages=CHAT, n=3, max_tokens=6, temperature=1.0, seed=1
    )
    assert len(many.choices) == 3 and many.usage.completion_tokens <= 18


DOC_A = "Radix trees store each shared prefix once; their edges hold runs of tokens. " * 3
DOC_B = "A paged KV pool hands out fixed-size pages of slots to running requests. " * 3


def rag_segments(first: str, second: str) -> list[dict]:
    return [
        {"text": "Use the documents to answer.\n"},
        {"text": first, "reusable": True},
        {"text": second, "reusable": True},
        {"text": "\nQuestion: what holds runs of tokens?"},
    ]


def test_generate_with_segments_reuses_passages_in_any_order(server, default_tokenizer):
    def gen(body):
        params = {"max_tokens": 6, "temperature": 0}
        r = post(server, "/generate", {"sampling_params": params, **body})
        assert r.status_code == 200, r.text
        return r.json()

    first = gen({"segments": rag_segments(DOC_A, DOC_B), "recompute_ratio": 1.0})
    meta = first["meta_info"]
    assert meta["segment_hits"] == 0 and meta["reused_tokens"] == 0
    assert meta["recomputed_tokens"] > 0  # stored on first sight; with ratio 1 all recomputed
    # ratio 1.0 is a plain prefill: the same output as the same tokens sent unmarked
    pieces = rag_segments(DOC_A, DOC_B)
    ids = [t for s in pieces for t in default_tokenizer.encode(s["text"], add_special_tokens=False)]
    plain = gen({"input_ids": ids})
    assert plain["output_ids"] == first["output_ids"]
    assert plain["meta_info"]["segment_hits"] == 0
    swapped = gen({"segments": rag_segments(DOC_B, DOC_A), "recompute_ratio": 0.0})
    meta = swapped["meta_info"]
    assert meta["segment_hits"] == 2 and meta["recomputed_tokens"] == 0
    assert meta["reused_tokens"] == first["meta_info"]["recomputed_tokens"]
    m = wait_idle(server)
    assert m["radix_segment_hits_total"] >= 2 and m["radix_segment_reused_tokens_total"] > 0
    assert m["radix_segment_recomputed_tokens_total"] > 0
    assert_healthy(server)


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"segments": []}, "segments"),
        ({"segments": [{"text": "a", "input_ids": [5]}]}, "exactly one of text and input_ids"),
        ({"segments": [{"text": ""}]}, "may not be empty"),
        ({"segments": [{"text": "a", "cache": True}]}, "segments.0.cache"),
        ({"segments": [{"text": "a"}], "input_ids": [5]}, "exactly one of input_ids"),
        ({"segments": [{"text": "a", "reusable": True}], "recompute_ratio": 2}, "recompute_ratio"),
        ({"input_ids": [5, 6], "recompute_ratio": 0.5}, "segments only"),
        ({"segments": [{"input_ids": [10**9], "reusable": True}]}, "token ids must be in"),
    ],
)
def test_bad_segments_get_a_clear_error(server, body, needle):
    r = post(server, "/generate", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert_healthy(server)


def test_chat_with_reusable_parts_reuses_them_in_any_order(server):
    def ask(first: str, second: str, ratio: float) -> dict:
        content = [
            {"type": "text", "text": "Documents:\n"},
            {"type": "text", "text": first, "reusable": True},
            {"type": "text", "text": second, "reusable": True},
            {"type": "text", "text": "\nWhat holds runs of tokens?"},
        ]
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
                "max_tokens": 4, "temperature": 0, "recompute_ratio": ratio}  # fmt: skip
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]

    doc_c, doc_d = DOC_A.upper(), DOC_B.upper()  # not stored by the /generate test
    first = ask(doc_c, doc_d, 1.0)
    assert first["segment_hits"] == 0 and first["recomputed_tokens"] > 0
    again = ask(doc_d, doc_c, 0.0)
    assert again["segment_hits"] == 2 and again["reused_tokens"] == first["recomputed_tokens"]
    bad = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT,
                                                "recompute_ratio": 0.5})  # fmt: skip
    assert bad.status_code == 400 and "reusable content parts" in bad.json()["error"]["message"]
    assert_healthy(server)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"n": 2}}, "sampling_params.n"),
        ("/generate", {"text": "hi", "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
        ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 0}},
         "sampling_params.max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": -5}, "top_k"),
        ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "seed": 2**70}, "seed"),
    ],
)  # fmt: skip
def test_errors_name_the_api_field_never_an_internal_class(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
    for internal in ("SamplingParams", "__init__", "keyword argument", "Traceback"):
        assert internal not in error["message"], error


def test_the_kv_events_address_is_for_the_admin_only(server):
    r = httpx.get(server + "/kv_events", headers=AUTH)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    # the admin learns that this server publishes none (it was started without them)
    assert httpx.get(server + "/kv_events", headers=ADMIN).status_code == 404


@pytest.mark.parametrize("ids", [[2**64], [10**23], [-1], [49152]])
def test_token_ids_beyond_the_vocabulary_are_a_400(server, ids):
    for path, body in (("/generate", {"input_ids": ids}), ("/v1/completions", {"prompt": ids})):
        r = post(server, path, body)
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"], r.text
