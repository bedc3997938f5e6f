"""``kill -9`` of the engine process: requests in flight fail fast with a short 503, the
server restarts the engine (backoff, logged, counted in /metrics) and answers 200 again; once
the restarts allowed by ``--engine-restarts`` are used up, the server exits 1."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

from testing.server import engine_pid, read_metrics, started_server

LONG = {"prompt": "hi", "n": 8, "max_tokens": 1000, "ignore_eos": True}


def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def stream_events(url: str, first_event: threading.Event) -> list[dict]:
    body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                first_event.set()
    return events


def wait_generating(url: str, running: int = 1, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while read_metrics(url, {})["num_running_reqs"] < running:
        assert time.monotonic() < deadline, "nothing started"
        time.sleep(0.05)


@pytest.mark.slow  # tens of seconds alone; runs in `make test-all`
def test_kill_9_fails_requests_fast_then_recovers_then_gives_up(tiny_model_dir):
    flags = f"--model {tiny_model_dir} --dtype float32 --max-total-tokens 1024 "
    flags += "--engine-restarts 1 --served-model-name tiny --log-level info"
    with started_server(*flags.split()) as srv, concurrent.futures.ThreadPoolExecutor(2) as pool:
        victim = engine_pid(srv.proc.pid)
        plain = pool.submit(post, srv.url, LONG)
        first_event = threading.Event()
        streamed = pool.submit(stream_events, srv.url, first_event)
        wait_generating(srv.url, running=2)
        assert first_event.wait(30), "the stream sent nothing"  # the kill lands mid-stream
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)

        r = plain.result(timeout=30)
        failed_after = time.monotonic() - killed_at
        assert r.status_code == 503 and r.headers["Retry-After"].isdigit(), r.text
        message = r.json()["error"]["message"]
        assert "engine" in message and "Traceback" not in r.text and len(message) < 200
        events = streamed.result(timeout=30)
        assert "error" in events[-1] and "Traceback" not in json.dumps(events[-1])
        assert failed_after < 5, failed_after

        saw_restarting = False
        while (h := httpx.get(srv.url + "/health")).status_code != 200:
            assert h.status_code == 503 and h.json()["status"] in ("restarting", "ready")
            saw_restarting = True
            assert time.monotonic() - killed_at < 60, "no 200 within 60 s of kill -9"
            time.sleep(0.1)
        recovered_after = time.monotonic() - killed_at
        assert saw_restarting and recovered_after < 60
        assert engine_pid(srv.proc.pid) != victim
        assert read_metrics(srv.url, {})["engine_restarts_total"] == 1
        ok = post(srv.url, {"prompt": "hi", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert "the engine died" in srv.log and "restarting the engine" in srv.log

        os.kill(engine_pid(srv.proc.pid), signal.SIGKILL)  # a second death: over the limit
        assert srv.proc.wait(timeout=60) == 1
        assert "giving up" in srv.log
        print(f"kill -9: errors after {failed_after:.2f} s, 200 after {recovered_after:.1f} s")
