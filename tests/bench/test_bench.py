"""The benchmark harness: workloads, the load generator, baselines, reports and the CLI.

Workload and report tests need no server. Failure modes (unreachable, HTTP 500, a hung
server, a cut stream, missing usage) run against small fake servers defined here. Token
counts and cached tokens are checked against a real ``radixserve serve`` over the tiny random
model, started by the harness's own ``baselines.ManagedServer``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from radixserve.bench import baselines, client, data
from radixserve.bench.cli import add_bench_parser
from radixserve.bench.client import BenchError, RequestRecord
from radixserve.bench.loadgen import LoadConfig, RunResult, run_load
from radixserve.bench.report import summarize
from radixserve.bench.vocab import WORDS
from radixserve.bench.workloads import build_workload, few_shot_prefix
from radixserve.cli import main
from testing.server import child_pids

FIXTURES = Path(__file__).parent / "fixtures"
SHAREGPT = str(FIXTURES / "sharegpt_truncated.json")
GSM8K = str(FIXTURES / "gsm8k_small.jsonl")


# ---------------------------------------------------------------- data and workloads


def test_sharegpt_truncated_tail_is_dropped_and_only_clean_chats_kept(monkeypatch):
    monkeypatch.setattr(data, "CHUNK_CHARS", 64)  # records straddle many chunk boundaries
    ids = [r["id"] for r in data.iter_records(SHAREGPT)]
    assert ids == ["c1", "c2", "c3", "c4", "c5", "c6"]  # c7 is cut off mid-string
    clean = list(data.iter_sharegpt(SHAREGPT))
    assert [cid for cid, _ in clean] == ["c1", "c5", "c6"]
    assert clean[1][1] == [
        "Name a planet with rings, please, and say why it has them.",
        "How thick are the rings?",
        "Could they disappear one day?",
    ]


def test_sharegpt_workload_caps_turns_and_user_message_length():
    w = build_workload(
        "sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=2, turns=2, max_user_chars=10
    )
    assert w.api == "chat" and [c.id for c in w.conversations] == ["c1", "c5"]
    assert w.conversations[1].user_turns == ("Name a pla", "How thick ")
    with pytest.raises(data.DatasetError, match="only 3 clean conversations with at least 2"):
        build_workload("sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=4, turns=2)
    with pytest.raises(data.DatasetError, match="only 0 clean conversations with at least 5"):
        build_workload("sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=1)
    # fewer turns are allowed when asked for: min_turns=2 keeps the two-turn chats of turns=5
    w = build_workload(
        "sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=3, min_turns=2
    )
    assert len(w.conversations) == 3
    with pytest.raises(ValueError, match="min_turns must be between 2 and turns"):
        build_workload("sharegpt-multiturn", dataset_path=SHAREGPT, turns=3, min_turns=4)


def test_jsonl_allows_only_a_cut_last_line(tmp_path):
    good = tmp_path / "cut.jsonl"
    good.write_text('{"question": "a", "answer": "b"}\n{"question": "c", "ans')
    assert list(data.iter_gsm8k(good)) == [("a", "b")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\nnot json\n{"question": "c", "answer": "d"}\n')
    with pytest.raises(data.DatasetError, match="line 2"):
        list(data.iter_gsm8k(bad))
    with pytest.raises(data.DatasetError, match="not found"):
        list(data.iter_records(tmp_path / "missing.json"))


def test_few_shot_prefix_is_identical_across_requests():
    w = build_workload("few-shot", dataset_path=GSM8K, num_shots=3, num_questions=3)
    records = list(data.iter_gsm8k(GSM8K))
    prefix = few_shot_prefix(records[:3])
    prompts = [c.user_turns[0] for c in w.conversations]
    assert w.api == "completions" and len(prompts) == 3
    for prompt, (question, answer) in zip(prompts, records[3:], strict=True):
        assert prompt == f"{prefix}Question: {question}\nAnswer:"
        assert answer not in prompt  # the asked question's answer is never in its prompt
    with pytest.raises(data.DatasetError, match="only 6 records"):
        build_workload("few-shot", dataset_path=GSM8K, num_shots=4, num_questions=3)


def test_random_prompts_share_nothing_and_are_reproducible():
    w = build_workload("random", seed=3, num_prompts=20, input_len=50)
    prompts = [c.user_turns[0].split() for c in w.conversations]
    assert all(len(p) == 50 and set(p) <= set(WORDS) for p in prompts)
    assert len({p[0] for p in prompts}) == 20  # no two share even their first word
    again = build_workload("random", seed=3, num_prompts=20, input_len=50)
    assert [c.user_turns for c in again.conversations] == [c.user_turns for c in w.conversations]
    other = build_workload("random", seed=4, num_prompts=20, input_len=50)
    assert [c.user_turns for c in other.conversations] != [c.user_turns for c in w.conversations]


def test_shared_prefix_groups_share_their_system_prompt_and_are_interleaved():
    w = build_workload(
        "shared-prefix", num_groups=3, prompts_per_group=4, system_prompt_len=40, question_len=5
    )
    groups: dict[str, set[str]] = {}
    for c in w.conversations:
        groups.setdefault(c.id.split("-")[0], set()).add(c.system)
        assert len(c.user_turns[0].split()) == 5
    assert len(groups) == 3 and all(len(s) == 1 for s in groups.values())
    assert len({next(iter(s)) for s in groups.values()}) == 3
    assert all(len(next(iter(s)).split()) == 40 for s in groups.values())
    order = [c.id.split("-")[0] for c in w.conversations]
    assert order != sorted(order)  # groups interleaved, so the schedule policy matters


def test_workload_parameters_are_validated():
    with pytest.raises(ValueError, match="num_groups must be a positive integer"):
        build_workload("shared-prefix", num_groups=0)
    with pytest.raises(ValueError, match="does not take"):
        build_workload("random", num_groups=2)
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope")


# ---------------------------------------------------------------- reports, metrics, CLI


def test_parse_metrics_sums_labels_and_keeps_watched_names():
    text = (
        "# HELP kv_cache_used_tokens x\n"
        'kv_cache_used_tokens{model_name="m"} 120.0\n'
        'radix_cache_hit_tokens_total{model_name="m"} 7\n'
        'radix_cache_hit_tokens_created{model_name="m"} 1.7e9\n'
        "llamacpp:prompt_tokens_total 37\n"
        "process_cpu_seconds_total 3.0\n"
    )
    assert client.parse_metrics(text) == {
        "kv_cache_used_tokens": 120.0,
        "radix_cache_hit_tokens_total": 7.0,
        "llamacpp:prompt_tokens_total": 37.0,
    }


def _record(turn: int, ttft: float, prompt: int | None, cached: int | None) -> RequestRecord:
    return RequestRecord(
        "c", turn, 0.0, success=True, ttft=ttft, e2e=ttft + 1.0, prompt_tokens=prompt,
        cached_tokens=cached, output_tokens=11,
    )  # fmt: skip


def test_summary_figures_and_missing_usage_is_not_zero():
    records = [_record(1, 0.5, 100, 0), _record(2, 0.2, 200, 150)]
    samples = [
        {"t": t, "kv_cache_used_tokens": used, "kv_cache_bytes_per_token": 1024}
        for t, used in ((0.0, 50), (1.0, 300))
    ]
    s = summarize(RunResult("m", records, 2.0, samples, True))
    assert s["cache_hit_rate"] == pytest.approx(150 / 300)
    assert s["ttft_by_turn_p50_s"] == {1: 0.5, 2: 0.2}
    assert s["requests_per_s"] == 1.0 and s["output_tokens_per_s"] == 11.0
    assert s["peak_kv_tokens"] == 300 and s["peak_kv_bytes"] == 300 * 1024
    assert records[0].tpot == pytest.approx(0.1)
    blind = summarize(RunResult("m", [_record(1, 0.5, None, None)], 1.0))
    assert blind["cache_hit_rate"] is None and blind["peak_kv_tokens"] is None
    assert blind["requests_imbalance"] is None  # not a router


def test_a_fleet_run_reports_the_routers_last_imbalance():
    samples = [
        {"t": 0.0, "radix_router_requests_imbalance": 2.0, "radix_router_prefill_imbalance": 3.0},
        {"t": 1.0, "radix_router_requests_imbalance": 1.1, "radix_router_prefill_imbalance": 1.2},
    ]
    s = summarize(RunResult("m", [_record(1, 0.5, 100, 0)], 1.0, samples, True))
    assert (s["requests_imbalance"], s["prefill_imbalance"]) == (1.1, 1.2)


def _bench_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="radixserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "random", "--num-groups", "2"], "--num-groups does not apply"),
        (["--workload", "nope"], "--workload: unknown 'nope'"),
        (["--systems", "radix,vllm"], "--systems: unknown 'vllm'"),
        (["--base-url", "http://x", "--model", "m"], "--model configures started systems"),
        (["--api-key", "k"], "--api-key is for a --base-url server"),
        (["--workload", "random", "--input-len", "0"], "--input-len must be a positive integer"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--max-concurrency", "two"], "--max-concurrency: invalid int value"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be in (0, 2]"),
        (["--instance-host-kv-memory", "1GiB"], "applies to fleet-* and single-big systems"),
        (
            ["--systems", "fleet-round-robin", "--instance-host-kv-memory", "lots"],
            "--instance-host-kv-memory: cannot read 'lots' as a memory size",
        ),
    ],
)
def test_bad_options_give_argparse_errors_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        args = _bench_parser().parse_args(["bench", *argv])
        args.func(args.parser, args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_draft_systems_differ_from_radix_only_in_their_draft_sources():
    settings = baselines.ServerSettings()
    radix = baselines.command("radix", settings)(8000)
    for system, sources in (("radix-nodrafts", "none"), ("radix-alldrafts", "grammar,text,cache")):
        argv = baselines.command(system, settings)(8000)
        assert argv[: len(radix)] == radix and argv[len(radix) :] == ["--draft-sources", sources]


def test_a_host_tier_goes_to_every_instance_and_n_times_to_the_single_big_one():
    settings = baselines.ServerSettings(
        instances=3, instance_kv_tokens=1000, instance_host_kv_memory="64MiB"
    )
    fleet = baselines.command("fleet-cache-aware", settings)(8000)
    big = baselines.command("single-big", settings)(8000)
    assert fleet[fleet.index("--max-total-tokens") + 1] == "1000"
    assert fleet[fleet.index("--host-kv-memory") + 1] == str(64 << 20)
    assert big[big.index("--max-total-tokens") + 1] == "3000"
    assert big[big.index("--host-kv-memory") + 1] == str(3 * (64 << 20))
    plain = baselines.ServerSettings(instances=3, instance_kv_tokens=1000)
    assert "--host-kv-memory" not in baselines.command("single-big", plain)(8000)
    with pytest.raises(BenchError, match="not radix"):
        baselines.command("radix", settings)


# ---------------------------------------------------------------- failure modes (fake servers)


class FakeServer:
    """An OpenAI-ish server in a thread; ``mode`` picks how it (mis)behaves."""

    def __init__(self, mode: str):
        self.mode, self.requests, self.auth, self.release = mode, [], [], threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if fake.mode == "auth" and self.path == "/v1/models":
                    return self.reply(401, b'{"error": {"message": "bad key"}}')
                body = {"data": [{"id": "fake"}]} if self.path == "/v1/models" else {}
                self.reply(200, json.dumps(body).encode())

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(request)
                fake.auth.append(self.headers.get("Authorization"))
                if fake.mode == "http-500":
                    return self.reply(500, b'{"error": {"message": "boom"}}')
                if fake.mode == "hang":
                    fake.release.wait(30)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                n = len(fake.requests)
                for piece in (f"answer {n}", " done"):
                    self.event({"choices": [{"index": 0, "delta": {"content": piece}}]})
                    if fake.mode == "cut":
                        return
                self.event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                if fake.mode != "no-usage":
                    usage = {"prompt_tokens": 10 * n, "completion_tokens": 2,
                             "prompt_tokens_details": {"cached_tokens": 10 * (n - 1)}}  # fmt: skip
                    self.event({"choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")

            def event(self, payload: dict) -> None:
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()

            def reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def make(mode: str = "ok") -> FakeServer:
        servers.append(FakeServer(mode))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _config(url: str, **overrides) -> LoadConfig:
    options = dict(warmup_requests=0, progress=False, metrics_interval=0, request_timeout=5.0)
    return LoadConfig(base_url=url, **{**options, **overrides})


def test_history_carries_the_streamed_answers(fake_server):
    server = fake_server("ok")
    w = build_workload("sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=1, turns=2)
    result = run_load(w, _config(server.url, api_key="secret"))
    first, second = result.records
    assert (first.turn, second.turn) == (1, 2) and first.success and second.success
    assert second.prompt_tokens == 20 and second.cached_tokens == 10 and second.output_tokens == 2
    messages = server.requests[1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "answer 1 done"
    assert server.requests[0]["stream_options"] == {"include_usage": True}
    assert server.auth == ["Bearer secret"] * 2


def test_a_repetition_penalty_goes_with_every_request_only_when_given(fake_server):
    w = build_workload("sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=1, turns=2)
    given, default = fake_server("ok"), fake_server("ok")
    run_load(w, _config(given.url, repetition_penalty=1.0, warmup_requests=1))
    run_load(w, _config(default.url))
    assert [r.get("repetition_penalty") for r in given.requests] == [1.0] * 3  # warm-up too
    assert len(default.requests) == 2
    assert not any("repetition_penalty" in r for r in default.requests)


def test_think_time_pauses_between_turns_the_same_for_every_run(fake_server):
    server = fake_server("ok")
    w = build_workload("sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=2, turns=2)

    def pauses(seed: int) -> list[float]:
        records = run_load(w, _config(server.url, think_time=0.2, seed=seed, max_concurrency=2))
        by_turn = {(r.conversation_id, r.turn): r for r in records.records}
        return [
            by_turn[c, 2].start_time - by_turn[c, 1].end_time
            for c in sorted({c for c, _ in by_turn})
        ]

    first, again, other = pauses(1), pauses(1), pauses(2)
    assert all(p > 0.005 for p in first) and sum(first) / len(first) < 1.0
    assert max(abs(a - b) for a, b in zip(first, again, strict=True)) < 0.1  # seeded
    assert max(abs(a - b) for a, b in zip(first, other, strict=True)) > 0.01
    with pytest.raises(ValueError, match="think_time"):
        _config(server.url, think_time=-1)


def test_refused_credentials_are_a_clear_error(fake_server):
    server = fake_server("auth")
    with pytest.raises(BenchError, match="refused us .HTTP 401.: check --api-key"):
        run_load(build_workload("random", num_prompts=1), _config(server.url))


def test_limits_bound_the_run_and_open_loop_arrivals_are_spread(fake_server):
    server = fake_server("ok")
    w = build_workload("random", num_prompts=6, input_len=4)
    assert len(run_load(w, _config(server.url, max_requests=3)).records) == 3
    t0 = time.monotonic()
    result = run_load(w, _config(server.url, request_rate=4.0, duration=0.6, seed=1))
    assert 1 <= len(result.records) < 6 and time.monotonic() - t0 < 5
    starts = [r.start_time for r in result.records]
    assert starts == sorted(starts) and all(r.success for r in result.records)
    closed = run_load(w, _config(server.url, max_concurrency=6)).records
    assert max(r.start_time for r in closed) < 0.5  # all at once


def test_missing_usage_is_recorded_as_none(fake_server):
    server = fake_server("no-usage")
    result = run_load(build_workload("random", num_prompts=1, input_len=4), _config(server.url))
    (record,) = result.records
    assert record.success and record.ttft is not None
    assert (record.prompt_tokens, record.cached_tokens, record.output_tokens) == (None,) * 3


@pytest.mark.parametrize(
    "mode, error", [("http-500", "HTTP 500"), ("cut", "ended before the answer finished")]
)
def test_server_errors_are_recorded_and_end_the_conversation(fake_server, mode, error):
    server = fake_server(mode)
    w = build_workload("sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=1, turns=2)
    (record,) = run_load(w, _config(server.url)).records  # turn 2 is never sent
    assert not record.success and error in record.error


def test_failing_warm_up_stops_the_run(fake_server):
    server = fake_server("http-500")
    with pytest.raises(BenchError, match="warm-up request .* failed: HTTP 500"):
        run_load(build_workload("random", num_prompts=1), _config(server.url, warmup_requests=1))


def test_hung_server_is_cut_by_the_request_timeout(fake_server):
    server = fake_server("hang")
    t0 = time.monotonic()
    result = run_load(
        build_workload("random", num_prompts=2), _config(server.url, request_timeout=1)
    )
    assert time.monotonic() - t0 < 10
    assert [r.success for r in result.records] == [False, False]
    assert "no complete answer within 1 s" in result.records[0].error


def test_unreachable_server_is_a_clear_error_not_a_hang(capsys, tmp_path):
    port = baselines.free_port()  # nothing listens there
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{port}"
    code = main(["bench", "--workload", "random", "--num-prompts", "1", "--no-progress",
                 "--base-url", url, "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 1 and time.monotonic() - t0 < 10
    out, err = capsys.readouterr()
    assert "cannot reach the server" in err
    assert json.loads(out.splitlines()[-1])["ok"] is False


def test_silent_server_fails_the_health_check(monkeypatch):
    monkeypatch.setattr(client, "HEALTH_TIMEOUT_S", 0.5)
    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(BenchError, match="did not answer within 0.5 s"):
            run_load(build_workload("random", num_prompts=1), _config(url))


def test_a_server_dying_at_startup_reports_its_log(tmp_path):
    settings = baselines.ServerSettings(radix_args=("--page-size", "0"), log_dir=tmp_path)
    server = baselines.ManagedServer("broken", baselines.command("radix", settings), settings)
    with pytest.raises(BenchError, match="exited with code 2 while starting(.|\n)*--page-size"):
        with server:
            pass


# ---------------------------------------------------------------- a real radixserve server


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    settings = baselines.ServerSettings(
        model=str(tiny_model_dir), slots=2, context_length=2048,
        log_dir=tmp_path_factory.mktemp("logs"), startup_timeout=120,
    )  # fmt: skip
    with baselines.ManagedServer("tiny-radix", baselines.command("radix", settings), settings) as s:
        yield s.base_url


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _chat_tokens(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_token_counts_and_turn_two_hits_the_cache(tiny_server, tiny_tokenizer, tmp_path):
    w = build_workload(
        "sharegpt-multiturn", dataset_path=SHAREGPT, num_conversations=2, turns=2, output_len=8
    )
    result = run_load(w, _config(tiny_server, max_concurrency=1, metrics_interval=0.1))
    assert [(r.conversation_id, r.turn) for r in result.records] == [
        ("c1", 1), ("c1", 2), ("c5", 1), ("c5", 2),
    ]  # fmt: skip
    assert all(r.success for r in result.records), [r.error for r in result.records]
    for conversation, (first, second) in zip(
        w.conversations, [result.records[:2], result.records[2:]], strict=True
    ):
        user = {"role": "user", "content": conversation.user_turns[0]}
        assert first.prompt_tokens == _chat_tokens(tiny_tokenizer, [user])
        assert first.cached_tokens < first.prompt_tokens  # at most the template's system prompt
        assert 1 <= first.output_tokens <= 8
        assert second.prompt_tokens > first.prompt_tokens + first.output_tokens
        assert second.cached_tokens >= first.prompt_tokens  # the whole first turn is reused
    assert result.records[0].cached_tokens == 0  # the cache was flushed after the warm-up
    s = summarize(result)
    assert s["peak_kv_tokens"] and s["peak_kv_bytes"] > s["peak_kv_tokens"]
    assert 0 < s["cache_hit_rate"] < 1


def test_shared_prefix_and_few_shot_reuse_their_prefix(tiny_server, tiny_tokenizer):
    shared = build_workload(
        "shared-prefix", num_groups=2, prompts_per_group=2, system_prompt_len=64,
        question_len=8, output_len=4,
    )  # fmt: skip
    seen: set[str] = set()
    result = run_load(shared, _config(tiny_server, max_concurrency=1))
    for conversation, record in zip(shared.conversations, result.records, strict=True):
        group = conversation.id.split("-")[0]
        if group in seen:
            assert record.cached_tokens >= 64  # the whole system prompt
        else:
            assert record.cached_tokens < 8  # at most the template's "<|im_start|>system"
        seen.add(group)
    few = build_workload("few-shot", dataset_path=GSM8K, num_shots=3, num_questions=3, output_len=4)
    prefix = len(tiny_tokenizer.encode(few_shot_prefix(list(data.iter_gsm8k(GSM8K))[:3])))
    records = run_load(few, _config(tiny_server, max_concurrency=1)).records
    for conversation, record in zip(few.conversations, records, strict=True):
        assert record.prompt_tokens == len(tiny_tokenizer.encode(conversation.user_turns[0]))
    assert records[0].cached_tokens == 0
    assert all(r.cached_tokens >= prefix - 2 for r in records[1:])  # -2: the boundary token


def test_random_prompts_get_no_cache_hits(tiny_server):
    w = build_workload("random", num_prompts=4, input_len=40, output_len=4)
    records = run_load(w, _config(tiny_server, max_concurrency=2)).records
    assert [r.prompt_tokens for r in records] == [40] * 4  # one token per vocabulary word
    assert [r.cached_tokens for r in records] == [0] * 4


def _run_cli(argv: list[str], capsys) -> tuple[int, dict]:
    code = main(["bench", "--no-progress", *argv])
    return code, json.loads(capsys.readouterr().out.splitlines()[-1])


def test_llamacpp_baseline_serves_the_same_gguf(tmp_path):
    pytest.importorskip("xllamacpp", reason="the llamacpp baseline needs `pip install xllamacpp`")
    settings = baselines.ServerSettings(slots=1, context_length=512, threads=1, log_dir=tmp_path)
    server = baselines.ManagedServer("llamacpp", baselines.command("llamacpp", settings), settings)
    with server:
        w = build_workload(
            "few-shot", dataset_path=GSM8K, num_shots=2, num_questions=2, output_len=2
        )
        records = run_load(w, _config(server.base_url, max_concurrency=1)).records
    assert [r.success for r in records] == [True, True]
    assert records[1].cached_tokens > 0 and records[1].prompt_tokens > records[1].cached_tokens
    assert server.proc is not None and server.proc.poll() is not None  # stopped


def test_cli_against_a_running_server_writes_every_report(tiny_server, tmp_path, capsys):
    argv = ["--workload", "sharegpt-multiturn,random", "--dataset-path", SHAREGPT,
            "--num-conversations", "2", "--turns", "2", "--num-prompts", "2",
            "--input-len", "16", "--output-len", "4", "--base-url", tiny_server,
            "--output-dir", str(tmp_path)]  # fmt: skip
    code, line = _run_cli(argv, capsys)
    assert code == 0 and line["ok"]
    assert line["workloads"]["random"]["base-url"]["requests_ok"] == 2
    names = {p.name for p in tmp_path.iterdir()}
    for workload in ("sharegpt-multiturn", "random"):
        for plot in ("ttft_cdf", "ttft_by_turn", "hit_rate"):
            assert f"{workload}_{plot}.png" in names
    results = json.loads((tmp_path / "results.json").read_text())
    records = results["workloads"]["sharegpt-multiturn"]["systems"]["base-url"]["records"]
    assert all(r["cached_tokens"] > 0 for r in records if r["turn"] == 2)
    assert "| base-url | 4/4 |" in (tmp_path / "report.md").read_text()


def test_cli_starts_the_no_cache_baseline_and_it_caches_nothing(tiny_model_dir, tmp_path, capsys):
    argv = ["--workload", "sharegpt-multiturn", "--dataset-path", SHAREGPT,
            "--num-conversations", "2", "--turns", "2", "--output-len", "4",
            "--systems", "no-cache", "--model", str(tiny_model_dir), "--context-length", "2048",
            "--max-concurrency", "2", "--output-dir", str(tmp_path)]  # fmt: skip
    code, line = _run_cli(argv, capsys)
    assert code == 0 and line["workloads"]["sharegpt-multiturn"]["no-cache"]["requests_ok"] == 4
    system = json.loads((tmp_path / "results.json").read_text())["workloads"][
        "sharegpt-multiturn"]["systems"]["no-cache"]  # fmt: skip
    assert "--disable-prefix-caching" in system["info"]["command"]
    assert [r["cached_tokens"] for r in system["records"]] == [0, 0, 0, 0]
    assert all(r["prompt_tokens"] > 0 for r in system["records"])
    assert system["summary"]["cache_hit_rate"] == 0.0
    assert (tmp_path / "logs" / "sharegpt-multiturn-no-cache.log").is_file()


@pytest.mark.slow  # seconds to tens of seconds alone; runs in `make test-all`
def test_a_terminated_bench_stops_the_servers_it_started(tiny_model_dir, tmp_path):
    argv = [sys.executable, "-m", "radixserve.cli", "bench", "--workload", "sharegpt-multiturn",
            "--dataset-path", SHAREGPT, "--num-conversations", "1", "--turns", "2",
            "--output-len", "4", "--think-time", "600", "--systems", "radix",
            "--model", str(tiny_model_dir), "--context-length", "2048", "--no-progress",
            "--output-dir", str(tmp_path)]  # fmt: skip
    bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        log = tmp_path / "logs" / "sharegpt-multiturn-radix.log"
        while time.monotonic() < deadline and not children:  # then it thinks for minutes
            time.sleep(0.5)
            if log.is_file() and "Application startup complete" in log.read_text():
                time.sleep(2)  # the warm-up and the first turn
                children = set(child_pids(bench.pid))
        assert children, "the bench's server never started"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in children):
            time.sleep(0.2)
        assert not any(_alive(p) for p in children)
    finally:
        bench.kill()
        for pid in children:  # a failed check leaves nothing running either
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
