"""Forwarding one inference request to a worker: retries, the first-byte timeout, relaying.

The body is read under the gate's size limit, then parsed, tokenized and hashed on a worker
thread (``prompts.py``), so a big body never stalls ``/health`` or other requests. The
request goes to the worker the policy picks, with the router's own worker credential and
never the client's ``Authorization`` or ``X-Radixserve-*`` headers (only the router sets
those). The response starts only once the worker sent its first body bytes, so a worker
that cannot be reached, answers 502/503/504, dies, is marked unhealthy, or sends nothing
within ``first_byte_timeout`` (it then counts as hung and leaves the fleet until a health
check passes) gets the request retried on another worker, and a client never sees half of
one worker's answer followed by another's. Once bytes flowed, a worker's failure ends the
answer: a stream with an error event (the server's own shape for an engine that died), as
the client would get from the server itself. The ticket of every attempt is finished in a
``finally``: success, error, retry or client disconnect, the load counters come back down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from radixserve.api.errors import ApiError
from radixserve.model.tokenizer import Tokenizer
from radixserve.router.config import RouterConfig
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import NoWorkerError, Route, RouteRequest
from radixserve.router.prompts import SESSION_HEADER, parse_body, route_request
from radixserve.router.workers import WorkerPool

RETRY_STATUSES = (502, 503, 504)
DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "transfer-encoding",
                        "accept-encoding", "keep-alive", "authorization", "x-api-key"}  # fmt: skip
KEEP_RESPONSE_HEADERS = ("content-type", "cache-control", "x-accel-buffering")
CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')
TAIL_BYTES = 8192
WORKER_HEADER = "x-radixserve-worker"  # which worker answered (the body is untouched)
Opened = tuple[httpx.Response, AsyncIterator[bytes], bytes]


def client_headers(request: Request) -> dict[str, str]:
    """What of the client's headers a worker may see: no credentials, no router headers."""
    return {
        k: v
        for k, v in request.headers.items()
        if k.lower() not in DROP_REQUEST_HEADERS and not k.lower().startswith("x-radixserve-")
    }


def _prepare(
    raw: bytes, path: str, session: str | None, tokenizer: Tokenizer, block: int, tenant
) -> tuple[dict[str, Any], RouteRequest]:
    body = parse_body(raw)
    headers = {SESSION_HEADER: session} if session is not None else {}
    return body, route_request(path, body, headers, tokenizer, block, tenant)


class Forwarder:
    def __init__(
        self, pool: WorkerPool, tokenizer: Tokenizer, config: RouterConfig, metrics: RouterMetrics
    ):
        self.pool, self.policy, self.client = pool, pool.policy, pool.client
        self.tokenizer, self.config, self.metrics = tokenizer, config, metrics

    async def __call__(self, request: Request, path: str) -> Response:
        raw = await request.body()
        tenant = getattr(request.state, "tenant", None)
        t0 = time.perf_counter()
        body, wanted = await asyncio.to_thread(
            _prepare, raw, path, request.headers.get(SESSION_HEADER), self.tokenizer,
            self.pool.block_size, tenant,
        )  # fmt: skip
        self.metrics.prepare.observe(time.perf_counter() - t0)
        model, served = body.get("model"), self.pool.model
        if isinstance(model, str) and served is not None and model != served:
            raise ApiError(404, f"model {model!r} not found; this router serves {served!r}",
                           param="model", code="model_not_found")  # fmt: skip
        headers = {**client_headers(request), **self.config.worker_headers(tenant)}
        route, opened = await self._first_answer(wanted, path, raw, headers)
        upstream, chunks, first = opened
        self.metrics.on_route(route.worker, wanted.num_tokens, route.cached_tokens)
        self.policy.first_token(route.ticket, time.monotonic())
        out_headers = {k: v for k, v in upstream.headers.items() if k in KEEP_RESPONSE_HEADERS}
        out_headers[WORKER_HEADER] = route.worker
        return StreamingResponse(
            self._relay(route, wanted.num_tokens, upstream, chunks, first),
            status_code=upstream.status_code,
            headers=out_headers,
        )

    async def _first_answer(
        self, wanted: RouteRequest, path: str, raw: bytes, headers: dict[str, str]
    ) -> tuple[Route, Opened]:
        """The route whose worker answered first bytes, retrying on others until one does."""
        tried: set[str] = set()
        while True:
            t0 = time.perf_counter()
            try:
                route = self.policy.route(wanted, time.monotonic(), exclude=tried)
            except NoWorkerError:
                self.metrics.failures.inc()
                raise ApiError(
                    503, "no worker could serve the request", kind="server_error"
                ) from None
            self.metrics.routing.observe(time.perf_counter() - t0)
            opened = await self._open(route, path, raw, {**headers, **route.headers})
            if opened is not None:
                return route, opened
            self.policy.finish(route.ticket, now=time.monotonic())
            self.pool.mark_failed(route.worker)
            tried.add(route.worker)
            self.metrics.retries.inc()

    async def _open(
        self, route: Route, path: str, raw: bytes, headers: dict[str, str]
    ) -> Opened | None:
        """The worker's response, its body iterator and first bytes; None if it failed,
        was marked unhealthy, or sent nothing within the first-byte timeout and then did not
        answer a health probe either (hung)."""
        worker = self.pool.workers.get(route.worker)
        if worker is None or worker.down.is_set():
            return None
        req = self.client.build_request("POST", route.worker + path, content=raw, headers=headers)
        opening = asyncio.create_task(self._first_bytes(req))
        down = asyncio.create_task(worker.down.wait())
        try:
            while True:  # a worker busy past the timeout but answering its health probe is
                done, _ = await asyncio.wait(  # slow, not hung: keep waiting for it
                    {opening, down},
                    timeout=self.config.first_byte_timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if done or not await self.pool.responds(worker):
                    break
        finally:
            down.cancel()
            if not opening.done():
                opening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            return await opening
        return None

    async def _first_bytes(self, req: httpx.Request) -> Opened | None:
        try:
            upstream = await self.client.send(req, stream=True)
        except httpx.TransportError:
            return None
        try:
            if upstream.status_code in RETRY_STATUSES:
                await upstream.aclose()
                return None
            chunks = upstream.aiter_raw()
            return upstream, chunks, await anext(chunks, b"")
        except httpx.TransportError:
            await upstream.aclose()
            return None
        except BaseException:  # cancelled: hung or marked unhealthy
            await upstream.aclose()
            raise

    async def _relay(
        self,
        route: Route,
        prompt_tokens: int,
        upstream: httpx.Response,
        chunks: AsyncIterator[bytes],
        first: bytes,
    ) -> AsyncIterator[bytes]:
        """The worker's bytes; a stream is passed on whole events at a time, so that one cut
        off mid-event ends with the error event, not with half an event."""
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        tail, held = b"", b""
        worker = self.pool.workers.get(route.worker)
        down = worker.down if worker is not None else None
        try:
            async for chunk in _until_down(_chain(first, chunks), down):
                tail = (tail + chunk)[-TAIL_BYTES:]
                if sse:
                    held += chunk
                    cut = held.rfind(b"\n\n") + 2 if b"\n\n" in held else 0
                    chunk, held = held[:cut], held[cut:]
                if chunk:
                    yield chunk
            if held:
                yield held
        except (httpx.TransportError, WorkerDown):
            self.pool.mark_failed(route.worker)  # died or hung mid-answer: it ends here
            if sse:
                yield _stream_error(route.worker)
        finally:
            await upstream.aclose()
            found = CACHED.findall(tail)
            reported = int(found[-1]) if found else None
            self.policy.finish(route.ticket, reported, time.monotonic())
            self.metrics.on_finish(route.worker, prompt_tokens, route.cached_tokens, reported)


class WorkerDown(Exception):
    """The worker was taken out of the fleet (hung or dead) while it was answering."""


async def _until_down(
    chunks: AsyncIterator[bytes], down: asyncio.Event | None
) -> AsyncIterator[bytes]:
    """``chunks`` until they end, or until ``down`` is set (``WorkerDown``): a worker that
    stops mid-answer sends nothing more, and its health checks are what tell."""
    it = aiter(chunks)
    while True:
        nxt = asyncio.ensure_future(anext(it))
        if down is None:
            waiting: set[asyncio.Future] = {nxt}
        else:
            waiting = {nxt, asyncio.ensure_future(down.wait())}
        done, pending = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            if task is not nxt:
                task.cancel()
        if nxt not in done:
            nxt.cancel()
            raise WorkerDown
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return


async def _chain(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in chunks:
        yield chunk


def _stream_error(worker: str) -> bytes:
    """The event the server sends when its engine dies mid-stream, for a worker that did."""
    error = ApiError(
        502, f"the worker {worker} failed while streaming this answer", kind="server_error"
    )
    return f"data: {json.dumps(error.body())}\n\n".encode()
