"""The recording proxy forwards requests unchanged, streams answers through as they come and
records both sides with the time each chunk arrived."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from radixserve.bench.agent_proxy import RecordingProxy


async def echo(request: Request):
    body = await request.json()
    headers = {"x-seen-key": request.headers.get("x-api-key", ""),
               "x-seen-query": request.url.query}  # fmt: skip
    if body.get("stream"):

        async def events():
            for i in range(3):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.2)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
    status = 400 if body.get("bad") else 200
    return JSONResponse({"echo": body}, status_code=status, headers=headers)


@contextlib.contextmanager
def upstream():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = Starlette(routes=[Route("/v1/echo", echo, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_requests_and_streams_pass_through_and_are_recorded():
    with upstream() as url, RecordingProxy(url) as proxy:
        r = httpx.post(proxy.url + "/v1/echo?beta=true", json={"a": 1},
                       headers={"x-api-key": "k", "anthropic-beta": "b1"})  # fmt: skip
        assert r.json() == {"echo": {"a": 1}} and r.headers["x-seen-key"] == "k"
        assert r.headers["x-seen-query"] == "beta=true"
        with httpx.stream("POST", proxy.url + "/v1/echo", json={"stream": True}) as s:
            received = [(time.monotonic(), line) for line in s.iter_lines() if line]
        bad = httpx.post(proxy.url + "/v1/echo", json={"bad": True})
        httpx.get(proxy.url + "/nowhere")
    assert [line for _, line in received] == ["data: 0", "data: 1", "data: 2"]
    # streamed through as it came: the lines arrived apart, not all at the end
    assert received[-1][0] - received[0][0] > 0.3
    first, stream, error, notfound = proxy.exchanges
    assert (first.method, first.path, first.status) == ("POST", "/v1/echo?beta=true", 200)
    assert first.request_headers["anthropic-beta"] == "b1"
    assert first.request_body == b'{"a":1}' and first.body == r.content
    assert stream.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    times = [t for t, _ in stream.chunks]
    assert len(times) == 3 and times[-1] - times[0] > 0.3 and stream.end >= times[-1]
    assert (error.status, notfound.status) == (400, 404) and bad.status_code == 400
    assert proxy.mark() == 4


def test_an_unreachable_upstream_is_a_502_recorded_with_its_reason():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with RecordingProxy(f"http://127.0.0.1:{port}") as proxy:
        r = httpx.post(proxy.url + "/v1/messages", json={})
    assert r.status_code == 502
    [ex] = proxy.exchanges
    assert ex.status == 0 and "unreachable" in ex.error and ex.end is not None


def test_the_journal_shows_each_request_and_its_stream_while_it_runs(tmp_path):
    journal = tmp_path / "journal.txt"
    with upstream() as url, RecordingProxy(url, journal=journal) as proxy:
        body = {"model": "m", "max_tokens": 7, "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/echo", json=body) as s:
            lines = s.iter_lines()
            assert next(lines) == "data: 0"
            # written as it comes: the first event is there before the stream ends
            seen = journal.read_text()
            assert "POST /v1/echo" in seen and "'max_tokens': 7" in seen
            assert "data: 0" in seen and "data: 2" not in seen
            list(lines)
    text = journal.read_text()
    assert "data: 2" in text and "[#0 " in text and "HTTP 200 end after" in text
    assert len(proxy.exchanges) == 1
