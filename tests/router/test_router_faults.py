"""The router under hostile tenants and failing workers, over two real workers (tiny model).

Tenants hold API keys, the operator the admin key; workers are reached with their own key
and never see a tenant's. Bad bodies are the router's 4xx in the OpenAI envelope, big ones
413 while ``/health`` stays fast; a hung worker's requests are retried elsewhere; a worker
dying mid-stream ends the stream with an error event. The last test kills a worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from radixserve.api.guard import key_tenant
from testing.fleet import idle, start_router, start_worker, stopping, wait_for
from testing.fuzz import fuzz_schema

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TENANTS = ["tenant-a", "tenant-b"]
A, B = ({"Authorization": f"Bearer {k}"} for k in TENANTS)
ADMIN = {"Authorization": "Bearer router-admin"}
WORKER_KEY = "worker-admin"
CHAT = "/v1/chat/completions"
KEY_FLAGS = ["--api-key", TENANTS[0], "--api-key", TENANTS[1], "--salt-from-api-key"]


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    procs = [start_worker(tiny_model_dir, *KEY_FLAGS, "--admin-key", WORKER_KEY) for _ in "ab"]
    with stopping(*procs):
        yield [p.wait() for p in procs]


def router_flags(*extra: str) -> list[str]:
    return [*KEY_FLAGS, "--admin-key", "router-admin", "--worker-api-key", WORKER_KEY,
            "--policy", "round-robin", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def router(tiny_model_dir, workers):
    proc = start_router(tiny_model_dir, [w.url for w in workers], *router_flags())
    with stopping(proc):
        yield proc


def model_of(url: str, headers=A) -> str:
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


def chat_body(url: str, text: str, **extra) -> dict:
    return {"model": model_of(url), "messages": [{"role": "user", "content": text}],
            "max_tokens": 4, "temperature": 0, **extra}  # fmt: skip


def assert_envelope(r: httpx.Response, status: int | tuple[int, ...]) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert {"message", "type", "code"} <= set(error) and error["message"], error
    return error


def wait_fleet_ok(url: str, timeout: float = 30.0) -> None:
    wait_for(lambda: httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok", timeout)


class Spy:
    """A fake worker on a real socket: answers like a radixserve worker and records the
    headers of every call it gets; ``close()`` takes it down."""

    def __init__(self, model: str):
        self.calls: list[tuple[str, dict[str, str]]] = []
        spy = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict) -> None:
                spy.calls.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._answer(200, {"data": [{"id": model}]})
                self._answer(200 if self.path == "/health" else 404, {})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                usage = {"prompt_tokens": 1, "completion_tokens": 1}
                self._answer(200, {"choices": [], "usage": usage, "flushed_tokens": 0})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_tenant_keys_cannot_manage_the_router(router, workers):
    url = router.url
    for method, path, kw in [
        ("GET", "/workers", {}),
        ("POST", "/workers", {"json": {"url": "http://127.0.0.1:9"}}),
        ("DELETE", "/workers", {"params": {"url": workers[0].url}}),
        ("POST", "/flush_cache", {}),
        ("GET", "/metrics", {}),
    ]:
        r = httpx.request(method, url + path, headers=B, timeout=30, **kw)
        assert assert_envelope(r, 403)["type"] == "permission_error", (method, path)
        r = httpx.request(method, url + path, timeout=30, **kw)
        assert_envelope(r, (401, 403))
    listed = httpx.get(f"{url}/workers", headers=ADMIN, timeout=10).json()["workers"]
    assert [w["url"] for w in listed] == [w.url for w in workers]  # nothing was changed
    assert httpx.get(f"{url}/metrics", headers=ADMIN, timeout=10).status_code == 200
    r = httpx.post(url + CHAT, json=chat_body(url, "hello"), headers=A, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"


def test_workers_get_the_worker_key_and_the_tenant_never_its_key(router, workers):
    url = router.url
    spy = Spy(model_of(url))
    try:
        r = httpx.post(f"{url}/workers", json={"url": spy.url}, headers=ADMIN, timeout=30)
        assert r.status_code == 201, r.text
        forged = {"X-Radixserve-Prefill": "tcp://127.0.0.1:9", "X-Radixserve-Tenant": "victim"}
        for i in range(3):  # round-robin over three workers: one reaches the spy
            body = chat_body(url, f"secret memo {i}")
            httpx.post(url + CHAT, json=body, headers={**A, **forged}, timeout=60)
        paths = [path for path, _ in spy.calls]
        assert {"/v1/models", "/kv_events", CHAT} <= set(paths), paths
        for path, headers in spy.calls:
            assert headers.get("authorization") == f"Bearer {WORKER_KEY}", (path, headers)
            assert "x-radixserve-prefill" not in headers, (path, headers)
        forwarded = [headers for path, headers in spy.calls if path == CHAT]
        assert [h.get("x-radixserve-tenant") for h in forwarded] == [key_tenant(TENANTS[0])]
    finally:
        httpx.delete(f"{url}/workers", params={"url": spy.url}, headers=ADMIN, timeout=30)
        spy.close()


def test_tenants_still_get_their_own_namespaces_on_the_workers(router):
    url = router.url
    body = chat_body(url, "a shared system prompt about radix trees " * 6)

    def cached(headers) -> int:
        r = httpx.post(url + CHAT, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for _ in range(3):  # round-robin: both workers hold tenant A's prompt afterwards
        cached(A)
    assert cached(A) > 32
    assert cached(B) == 0  # tenant B shares nothing with A on either worker


def test_the_worker_trusts_a_named_tenant_from_the_admin_key_only(router, workers):
    """The router names the tenant with the worker's admin key; a tenant talking to a
    worker directly cannot borrow another tenant's namespace by naming it."""
    worker = workers[0].url
    body = chat_body(router.url, "only for tenant b, and long enough to be cached " * 8)

    def cached(headers) -> int:
        r = httpx.post(worker + CHAT, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    key = {"Authorization": f"Bearer {WORKER_KEY}"}
    named = {**key, "X-Radixserve-Tenant": "t-b"}
    cached(named)
    assert cached(named) > 100
    # (at most the chat template's head is cached in another namespace)
    assert cached(key) < 50  # the admin key's own namespace: the header did choose one
    assert cached({**A, "X-Radixserve-Tenant": "t-b"}) < 50  # ignored from a tenant


@pytest.mark.parametrize(
    "path,raw",
    [
        ("/generate", '{"input_ids": [1e400]}'),
        ("/generate", '{"input_ids": [Infinity]}'),
        ("/generate", '{"input_ids": [4294967296]}'),
        ("/generate", '{"input_ids": [99999999999999999999999]}'),
        ("/v1/completions", '{"prompt": [4294967296], "max_tokens": 2}'),
        ("/v1/completions", "[" * 100_000 + "]" * 100_000),
        (CHAT, '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ("/generate", "not json"),
        ("/generate", "[1, 2]"),
    ],
)
def test_malformed_bodies_are_4xx_in_the_envelope(router, path, raw):
    headers = {**A, "Content-Type": "application/json"}
    r = httpx.post(router.url + path, content=raw, headers=headers, timeout=60)
    assert_envelope(r, 400)


def test_errors_of_the_router_itself_are_in_the_envelope(router):
    url = router.url
    assert_envelope(httpx.get(url + "/no/such/path", headers=A, timeout=10), 404)
    assert_envelope(httpx.delete(url + "/workers", headers=ADMIN, timeout=10), 400)
    r = httpx.post(url + "/workers", content=b"{", headers=ADMIN, timeout=10)
    assert_envelope(r, 400)


def test_flush_cache_with_a_worker_down_is_a_clean_502(router):
    url = router.url
    spy = Spy(model_of(url))
    try:
        r = httpx.post(f"{url}/workers", json={"url": spy.url}, headers=ADMIN, timeout=30)
        assert r.status_code == 201, r.text
        spy.close()
        error = assert_envelope(httpx.post(f"{url}/flush_cache", headers=ADMIN, timeout=60), 502)
        assert spy.url in error["message"]
    finally:
        httpx.delete(f"{url}/workers", params={"url": spy.url}, headers=ADMIN, timeout=30)


def test_big_bodies_get_413_and_health_stays_fast(router):
    url = router.url
    huge = json.dumps(chat_body(url, "word " * 4_000_000)).encode()  # 20 MB
    big = json.dumps(chat_body(url, "word " * 200_000)).encode()  # 1 MB: within the limit
    stalls: list[float] = []
    done = threading.Event()

    def poll_health():
        while not done.is_set():
            t0 = time.monotonic()
            httpx.get(f"{url}/health", timeout=30)
            stalls.append(time.monotonic() - t0)
            time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        headers = {**A, "Content-Type": "application/json"}
        r = httpx.post(url + CHAT, content=huge, headers=headers, timeout=120)
        assert_envelope(r, 413)

        def chunked():
            for i in range(0, len(huge), 1 << 20):
                yield huge[i : i + (1 << 20)]

        r = httpx.post(url + CHAT, content=chunked(), headers=headers, timeout=120)
        assert_envelope(r, 413)
        r = httpx.post(url + CHAT, content=big, headers=headers, timeout=120)
        assert_envelope(r, 400)  # the worker's: the prompt does not fit its context
    finally:
        done.set()
        poller.join()
    # (tokenizing the 1 MB body takes seconds; the 20 MB one, had it been read, far longer)
    assert len(stalls) > 3 and max(stalls) < 2.0, stalls


@pytest.mark.slow  # tens of seconds alone; runs in `make test-all`
@pytest.mark.parametrize("examples", [4, 40])
def test_fuzz_the_router_openapi_schema_finds_no_5xx(router, examples):
    """Schema-driven bodies, valid and invalid, for every router endpoint (schemathesis),
    with the admin key; the fleet is whole and idle afterwards."""
    seen, failures = fuzz_schema(router.url, ADMIN, model_of(router.url), examples)
    assert not failures, failures
    assert seen.get(200, 0) >= examples // 2, seen  # the fuzzer did reach the workers
    wait_fleet_ok(router.url)
    wait_for(lambda: idle(router.url, ADMIN), timeout=60)


@pytest.mark.slow  # tens of seconds alone; runs in `make test-all`
def test_a_hung_worker_is_routed_around(tiny_model_dir, router, workers):
    """Worker 1 stopped (SIGSTOP): requests sent to it are retried on worker 0 once it sent
    nothing for --first-byte-timeout (2 s) or, with the module router's long timeout, once
    health checks mark it down."""
    short = start_router(tiny_model_dir, [w.url for w in workers],
                         *router_flags("--first-byte-timeout", "2"))  # fmt: skip
    pid = workers[1].proc.pid

    async def one(client, url, i):
        body = chat_body(url, f"hung {i}")
        t0 = time.monotonic()
        r = await client.post(url + CHAT, json=body, headers=A)
        return r.status_code, r.headers.get("x-radixserve-worker"), time.monotonic() - t0

    async def main():
        async with httpx.AsyncClient(timeout=40) as client:
            calls = [one(client, u, i) for u in (short.url, router.url) for i in range(4)]
            return await asyncio.gather(*calls)

    with stopping(short):
        os.kill(pid, signal.SIGSTOP)
        try:
            results = asyncio.run(main())
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [s for s, _, _ in results] == [200] * 8, results
        assert {w for _, w, _ in results} == {workers[0].url}, results
        assert max(t for _, _, t in results[:4]) < 2 + 8, results  # the timeout
        assert max(t for _, _, t in results[4:]) < 20, results  # the health checks
    wait_fleet_ok(router.url)


@pytest.mark.slow  # seconds to tens of seconds alone; runs in `make test-all`
def test_a_busy_worker_past_the_first_byte_timeout_is_not_taken_for_hung(tiny_model_dir, workers):
    """A long answer that is not streamed sends nothing until it is whole: past
    --first-byte-timeout the worker answers its health probe, so the request keeps waiting for
    it and no worker leaves the fleet (taking it for hung refused the request with a 503)."""
    short = start_router(tiny_model_dir, [w.url for w in workers],
                         *router_flags("--first-byte-timeout", "0.2"))  # fmt: skip
    with stopping(short):
        body = chat_body(short.url, "count", max_tokens=600, ignore_eos=True)
        t0 = time.monotonic()
        r = httpx.post(short.url + CHAT, json=body, headers=A, timeout=120)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 600
        assert took > 0.2, took  # the timeout did pass while the worker computed
        listing = httpx.get(short.url + "/workers", headers=ADMIN, timeout=10).json()
        assert all(w["healthy"] for w in listing["workers"]), listing


def stream_cut_on_worker(url: str, worker, cut, resume=None) -> tuple[int, list[str], float]:
    """Stream a long chat until it lands on ``worker`` (round-robin: one of two does), call
    ``cut()`` after its first 3 lines, read the rest: (status, the SSE events' data, seconds
    the rest took). ``resume()`` runs once the rest is read, however the read ended."""
    body = chat_body(url, "count to a thousand", max_tokens=2000, ignore_eos=True, stream=True)
    with httpx.Client(timeout=60) as client:
        for _ in range(2):
            with client.stream("POST", url + CHAT, json=body, headers=A) as r:
                if r.headers["x-radixserve-worker"] != worker.url:
                    continue
                lines = r.iter_lines()
                seen = [next(lines) for _ in range(3)]
                cut()
                t0 = time.monotonic()
                try:
                    seen += list(lines)
                    took = time.monotonic() - t0
                finally:
                    if resume is not None:
                        resume()
                events = [line[6:] for line in seen if line.startswith("data: ")]
                return r.status_code, events, took
    raise AssertionError(f"no stream went to {worker.url}")


@pytest.mark.slow  # seconds to tens of seconds alone; runs in `make test-all`
def test_a_worker_stopped_mid_stream_ends_the_stream_once_health_checks_take_it_out(
    router, workers
):
    """Worker 1 stopped (SIGSTOP) while it streams: its health checks fail, and the stream
    ends with an error event then, instead of waiting for the worker to come back."""
    pid = workers[1].proc.pid
    _, events, took = stream_cut_on_worker(
        router.url,
        workers[1],
        cut=lambda: os.kill(pid, signal.SIGSTOP),
        resume=lambda: os.kill(pid, signal.SIGCONT),
    )
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["type"] == "server_error"
    assert took < 30, took  # the health checks' time, not the worker's
    wait_fleet_ok(router.url)


def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event(router, workers):
    """Last: kills worker 1."""
    pid = workers[1].proc.pid
    status, events, _ = stream_cut_on_worker(
        router.url, workers[1], cut=lambda: os.kill(pid, signal.SIGKILL)
    )
    assert status == 200 and events[0].startswith("{")
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["type"] == "server_error" and workers[1].url in last["error"]["message"]
    assert all(json.loads(e) for e in events)  # whole events only
