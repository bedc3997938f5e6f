"""A recording reverse proxy between an agent and the server it talks to.

An agent (Claude Code, Codex CLI, a Python agent) is a program we do not control: what it
sent and what it got back is known only on the wire. ``RecordingProxy`` listens on a free
loopback port, forwards every request unchanged to the upstream server (any path, any
method) and streams the answer back as it arrives, keeping a copy of both sides as an
``Exchange``: the request body and headers, the status, the response headers, and the body's
chunks each with the time it reached the proxy. ``agent_transcript.py`` reads the exchanges:
which were parsed, whether each stream is well formed, the usage each reports, the time to
the first token.

The proxy runs uvicorn in a thread of the calling process (``with RecordingProxy(url) as
proxy:``); ``proxy.url`` is what the agent is pointed at. It asks the upstream for an
uncompressed body (``accept-encoding: identity``) so that what it records is readable, and
drops the hop-by-hop headers. Times are ``time.monotonic()`` seconds.

With a ``journal`` file, each exchange is also written there as it happens (one line when a
request arrives, with its size, its ``max_tokens`` and its model; the answer's text as it
streams; one line when it ends, with its times): a session that takes an hour on a slow
machine can be watched with ``tail -f`` while it runs.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
              "te", "trailer", "upgrade", "proxy-authorization", "accept-encoding"}  # fmt: skip
STREAM_CUT = "stream cut"  # how ``Exchange.error`` begins when the relay stopped midway
RECORDED_REQUEST_HEADERS = ("user-agent", "anthropic-beta", "anthropic-version", "content-type")


@dataclass
class Exchange:
    """One request and its answer as they crossed the proxy."""

    method: str
    path: str  # with the query string
    request_headers: dict[str, str]  # RECORDED_REQUEST_HEADERS that were present
    request_body: bytes
    start: float  # the request reached the proxy
    status: int = 0  # 0: no answer from the upstream (``error`` says why)
    response_headers: dict[str, str] = field(default_factory=dict)
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival time, bytes)
    end: float | None = None  # the answer's last byte reached the proxy
    error: str | None = None

    @property
    def body(self) -> bytes:
        return b"".join(c for _, c in self.chunks)


class RecordingProxy:
    """Forwards everything to ``upstream`` and records it in ``exchanges`` (in the order the
    requests arrived)."""

    def __init__(self, upstream: str, timeout: float = 3600.0, journal: Path | None = None):
        self.upstream = upstream.rstrip("/")
        self.timeout = timeout
        self.journal_path = journal
        self._journal: TextIO | None = None
        self.exchanges: list[Exchange] = []
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RecordingProxy:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        if self.journal_path is not None:
            self._journal = open(self.journal_path, "a", buffering=1)  # noqa: SIM115
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=METHODS)])
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=30)
        if self._journal is not None:
            self._journal.close()

    def _note(self, index: int, text: str) -> None:
        if self._journal is not None:
            self._journal.write(f"\n[#{index} {time.strftime('%H:%M:%S')}] {text}\n")

    def _note_request(self, index: int, ex: Exchange) -> None:
        if self._journal is None:
            return
        try:
            body = json.loads(ex.request_body) if ex.request_body else {}
        except ValueError:
            body = {}
        keys = ("model", "max_tokens", "max_output_tokens", "stream")
        seen = {k: body[k] for k in keys if isinstance(body, dict) and k in body}
        self._note(index, f"{ex.method} {ex.path} {len(ex.request_body)} bytes {seen}")

    def mark(self) -> int:
        """How many exchanges there are so far: ``exchanges[mark:]`` are those after it."""
        return len(self.exchanges)

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        ex = Exchange(
            method=request.method, path=path, request_body=body, start=time.monotonic(),
            request_headers={k: request.headers[k] for k in RECORDED_REQUEST_HEADERS
                             if k in request.headers},
        )  # fmt: skip
        self.exchanges.append(ex)
        index = len(self.exchanges) - 1
        self._note_request(index, ex)
        client = httpx.AsyncClient(timeout=self.timeout)
        upstream = client.build_request(
            request.method, self.upstream + path, content=body,
            headers={**headers, "accept-encoding": "identity"},
        )  # fmt: skip
        try:
            answer = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            await client.aclose()
            ex.error, ex.end = f"upstream unreachable: {e!r}", time.monotonic()
            self._note(index, ex.error)
            return Response(ex.error, status_code=502)
        ex.status = answer.status_code
        ex.response_headers = {k: v for k, v in answer.headers.items()}

        async def relay():
            try:
                async for chunk in answer.aiter_raw():
                    ex.chunks.append((time.monotonic(), chunk))
                    if self._journal is not None:
                        self._journal.write(chunk.decode(errors="replace"))
                    yield chunk
            except (httpx.HTTPError, asyncio.CancelledError) as e:
                ex.error = f"{STREAM_CUT}: {e!r}"
                raise
            finally:
                ex.end = time.monotonic()
                first = round(ex.chunks[0][0] - ex.start, 1) if ex.chunks else None
                took = f"end after {ex.end - ex.start:.1f} s, first byte {first} s"
                self._note(index, f"HTTP {ex.status} {took} {ex.error or ''}")
                await answer.aclose()
                await client.aclose()

        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(relay(), status_code=answer.status_code, headers=kept)


METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
