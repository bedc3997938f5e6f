"""``radixserve router``'s HTTP front: an OpenAI-compatible API over a fleet of workers.

Each request is tokenized like the server does (``prompts.py``), routed by the policy and
forwarded untouched (body, headers, streamed bytes). The response starts only once the worker
sent its first body bytes, so a worker that cannot be reached, answers 502/503/504, or dies
before its first bytes, gets the request retried on another worker, and a client never sees
half of one worker's answer followed by another's. Once bytes flowed, a worker's failure ends
the stream. The ticket of every attempt is finished in a ``finally``: success, error, retry
or client disconnect, the load counters always come back down.

Endpoints: the OpenAI ones (chat, completions, ``/v1/models``), ``/generate``, ``/health``,
``/metrics``, ``/flush_cache`` (every worker), and ``/workers`` (GET lists, POST
``{"url": ...}`` adds, DELETE ``?url=...`` removes). An unknown ``model`` is a 404 from the
router itself. With an API key, every endpoint but ``/health`` needs it (workers check it too).
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.model.tokenizer import Tokenizer
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import NoWorkerError, Route
from radixserve.router.prompts import parse_body, route_request
from radixserve.router.workers import WorkerError, WorkerPool
from radixserve.server.protocol import ApiError

RETRY_STATUSES = (502, 503, 504)
DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "transfer-encoding",
                        "accept-encoding", "keep-alive"}  # fmt: skip
KEEP_RESPONSE_HEADERS = ("content-type", "cache-control", "x-accel-buffering")
CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')
TAIL_BYTES = 8192
WORKER_HEADER = "x-radixserve-worker"  # which worker answered (the body is untouched)


def _error(status: int, message: str, kind: str = "invalid_request_error", **kw) -> JSONResponse:
    return JSONResponse(ApiError(status, message, kind=kind, **kw).body(), status_code=status)


def create_router_app(
    pool: WorkerPool,
    tokenizer: Tokenizer,
    api_keys: list[str] | None = None,
    prefill_pool: WorkerPool | None = None,
    salt_from_api_key: bool = False,
) -> FastAPI:
    """``pool``: the workers requests go to (the decode instances in prefill/decode mode,
    where ``prefill_pool`` holds the prefill instances and the policy is a ``PDPolicy``);
    ``api_keys``: the keys the router accepts (the workers check them too);
    ``salt_from_api_key``: the workers give every key its own cache namespace."""
    app = FastAPI(title="radixserve router")
    policy, client = pool.policy, pool.client
    metrics = RouterMetrics(policy)
    app.state.pool, app.state.metrics = pool, metrics

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_keys and request.url.path != "/health":
            given = request.headers.get("authorization", "").encode()
            if not any(secrets.compare_digest(given, f"Bearer {k}".encode()) for k in api_keys):
                return _error(401, "missing or wrong API key", "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = pool.healthy_urls()
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "error", "workers": len(healthy)},
                            status_code=status)  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict:
        name = pool.model or "unknown"
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "owned_by": "radixserve"}],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def list_workers() -> dict:
        listing = {
            "policy": policy.name,
            "workers": [w.describe(policy) for w in pool.workers.values()],
        }
        if prefill_pool is not None:  # prefill/decode mode: "workers" are the decode ones
            p = prefill_pool.policy
            listing["prefill"] = [w.describe(p) for w in prefill_pool.workers.values()]
            listing["split"] = dataclasses.asdict(policy.pd_stats)
        return listing

    @app.post("/workers")
    async def add_worker(request: Request) -> JSONResponse:
        if prefill_pool is not None:
            return _error(400, "workers are fixed in prefill/decode mode (--prefill, --decode)")
        body = parse_body(await request.body())
        if not body or not isinstance(body.get("url"), str):
            return _error(400, 'give the worker as {"url": "http://HOST:PORT"}', param="url")
        try:
            worker = await pool.add(body["url"])
        except WorkerError as e:
            return _error(400, str(e), param="url")
        return JSONResponse(worker.describe(policy), status_code=201)

    @app.delete("/workers")
    async def remove_worker(url: str) -> JSONResponse:
        if not await pool.remove(url):
            return _error(404, f"no worker {url}", param="url")
        return JSONResponse({"removed": url.rstrip("/")})

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> JSONResponse:
        headers = _forward_headers(request)
        total = 0
        for each in (pool, prefill_pool) if prefill_pool is not None else (pool,):
            for worker in each.workers.values():
                r = await client.post(f"{worker.url}/flush_cache", headers=headers, timeout=60)
                if r.status_code != 200:
                    return Response(r.content, r.status_code, media_type="application/json")
                total += int(r.json().get("flushed_tokens", 0))
                each.policy.worker_lost_events(worker.url)  # events will tell what is left
        return JSONResponse({"flushed_tokens": total})

    async def proxy(request: Request, path: str) -> Response:
        raw = await request.body()
        body = parse_body(raw)
        model = body.get("model") if body is not None else None
        if isinstance(model, str) and pool.model is not None and model != pool.model:
            return _error(404, f"model {model!r} not found; this router serves {pool.model!r}",
                          param="model", code="model_not_found")  # fmt: skip
        t0 = time.perf_counter()
        wanted = route_request(
            path, body, dict(request.headers), tokenizer, pool.block_size, salt_from_api_key
        )
        metrics.prepare.observe(time.perf_counter() - t0)
        headers = _forward_headers(request)
        tried: set[str] = set()
        while True:
            t0 = time.perf_counter()
            try:
                route = policy.route(wanted, time.monotonic(), exclude=tried)
            except NoWorkerError:
                metrics.failures.inc()
                return _error(503, "no worker could serve the request", "server_error")
            metrics.routing.observe(time.perf_counter() - t0)
            upstream, chunks, first = await _open(route, path, raw, {**headers, **route.headers})
            if upstream is None:
                policy.finish(route.ticket, now=time.monotonic())
                pool.mark_failed(route.worker)
                tried.add(route.worker)
                metrics.retries.inc()
                continue
            break
        metrics.on_route(route.worker, wanted.num_tokens, route.cached_tokens)
        policy.first_token(route.ticket, time.monotonic())
        out_headers = {k: v for k, v in upstream.headers.items() if k in KEEP_RESPONSE_HEADERS}
        out_headers[WORKER_HEADER] = route.worker
        return StreamingResponse(
            _relay(route, wanted.num_tokens, upstream, chunks, first),
            status_code=upstream.status_code,
            headers=out_headers,
        )

    async def _open(route: Route, path: str, raw: bytes, headers: dict[str, str]):
        """The worker's response, its body iterator and first bytes; Nones if it failed first."""
        upstream = None
        try:
            req = client.build_request("POST", route.worker + path, content=raw, headers=headers)
            upstream = await client.send(req, stream=True)
            if upstream.status_code in RETRY_STATUSES:
                await upstream.aclose()
                return None, None, b""
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")
            return upstream, chunks, first
        except httpx.TransportError:
            if upstream is not None:
                await upstream.aclose()
            return None, None, b""

    async def _relay(
        route: Route,
        prompt_tokens: int,
        upstream: httpx.Response,
        chunks: AsyncIterator[bytes],
        first: bytes,
    ) -> AsyncIterator[bytes]:
        tail = first[-TAIL_BYTES:]
        try:
            if first:
                yield first
            async for chunk in chunks:
                tail = (tail + chunk)[-TAIL_BYTES:]
                yield chunk
        except httpx.TransportError:
            pool.mark_failed(route.worker)  # died mid-answer: the stream ends here
        finally:
            await upstream.aclose()
            found = CACHED.findall(tail)
            reported = int(found[-1]) if found else None
            policy.finish(route.ticket, reported, time.monotonic())
            metrics.on_finish(route.worker, prompt_tokens, route.cached_tokens, reported)

    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        app.add_api_route(path, _endpoint(proxy, path), methods=["POST"])
    return app


def _endpoint(proxy, path: str):
    async def endpoint(request: Request) -> Response:
        return await proxy(request, path)

    return endpoint


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in DROP_REQUEST_HEADERS}
