"""``radixserve router``'s HTTP front: an OpenAI-compatible API over a fleet of workers.

Inference endpoints (the OpenAI ones, ``/generate``) are forwarded to the worker the policy
picks (``forward.py``); ``/v1/models`` names the fleet's model; an unknown ``model`` is a 404
from the router itself. Management endpoints: ``/metrics``, ``/flush_cache`` (every worker;
502 naming the workers that could not be flushed), and ``/workers`` (GET lists, POST
``{"url": ...}`` adds, DELETE ``?url=...`` removes).

Who may call what (``config.py``): with API keys, every endpoint but ``/health`` needs one,
and the management endpoints need the admin key (closed when none is configured). Bodies
over ``max_request_bytes`` are refused with 413 before they are read. Every error is in the
OpenAI envelope, as the server's (``api/errors.py``).

``/health``: 200 ``ok`` when every worker is healthy, 200 ``degraded`` when some are not
(the fleet still serves), 503 ``error`` when no worker requests go to is; with the counts.
"""

from __future__ import annotations

import dataclasses

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.api.errors import ApiError, install_error_handlers
from radixserve.api.guard import Guard
from radixserve.model.tokenizer import Tokenizer
from radixserve.router.config import ADMIN_PATHS, RouterConfig
from radixserve.router.forward import Forwarder
from radixserve.router.metrics import RouterMetrics
from radixserve.router.openapi import BODIES, describe_bodies
from radixserve.router.prompts import parse_body
from radixserve.router.workers import WorkerError, WorkerPool

INFERENCE_PATHS = tuple(BODIES)


def fleet_health(pools: list[WorkerPool]) -> tuple[int, dict]:
    """``/health``'s status code and body over the given worker pools; the first is the one
    requests go to (without prefill instances, decode instances prefill themselves)."""
    total = sum(len(p.workers) for p in pools)
    healthy = sum(len(p.healthy_urls()) for p in pools)
    serving = bool(pools[0].healthy_urls())
    status = "ok" if serving and healthy == total else "degraded" if serving else "error"
    body = {"status": status, "workers": healthy, "unhealthy": total - healthy}
    return (200 if serving else 503), body


def create_router_app(
    pool: WorkerPool,
    tokenizer: Tokenizer,
    config: RouterConfig | None = None,
    prefill_pool: WorkerPool | None = None,
) -> FastAPI:
    """``pool``: the workers requests go to (the decode instances in prefill/decode mode,
    where ``prefill_pool`` holds the prefill instances and the policy is a ``PDPolicy``)."""
    config = config or RouterConfig()
    app = FastAPI(title="radixserve router")
    app.add_middleware(Guard, config=config.guard_config(), admin_paths=ADMIN_PATHS)
    install_error_handlers(app)
    policy, client = pool.policy, pool.client
    metrics = RouterMetrics(policy)
    forward = Forwarder(pool, tokenizer, config, metrics)
    pools = [pool] if prefill_pool is None else [pool, prefill_pool]
    app.state.pool, app.state.metrics = pool, metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = fleet_health(pools)
        return JSONResponse(body, status_code=status)

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
            raise ApiError(400, "workers are fixed in prefill/decode mode (--prefill, --decode)")
        body = parse_body(await request.body())
        if not isinstance(body.get("url"), str):
            raise ApiError(400, 'give the worker as {"url": "http://HOST:PORT"}', param="url")
        try:
            worker = await pool.add(body["url"])
        except WorkerError as e:
            raise ApiError(400, str(e), param="url") from None
        return JSONResponse(worker.describe(policy), status_code=201)

    @app.delete("/workers")
    async def remove_worker(url: str) -> JSONResponse:
        if not await pool.remove(url):
            raise ApiError(404, f"no worker {url}", param="url", kind="not_found_error")
        return JSONResponse({"removed": url.rstrip("/")})

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        return JSONResponse({"flushed_tokens": await flush_workers(pools, client)})

    for path in INFERENCE_PATHS:
        app.add_api_route(path, _endpoint(forward, path), methods=["POST"])
    describe_bodies(app)
    return app


async def flush_workers(pools: list[WorkerPool], client: httpx.AsyncClient) -> int:
    """Flush every worker's cache; the tokens flushed, or a 502 naming the workers that failed."""
    total, failed = 0, []
    for each in pools:
        for worker in list(each.workers.values()):
            try:
                r = await client.post(f"{worker.url}/flush_cache", timeout=60)
                if r.status_code == 200:
                    total += int(r.json().get("flushed_tokens", 0))
                else:
                    failed.append(f"{worker.url} answered {r.status_code}")
            except (httpx.HTTPError, ValueError) as e:
                failed.append(f"{worker.url}: {type(e).__name__}")
            each.policy.worker_lost_events(worker.url)  # events will tell what is left
    if failed:
        message = f"could not flush {'; '.join(failed)} (flushed {total} tokens elsewhere)"
        raise ApiError(502, message, kind="server_error")
    return total


def _endpoint(forward: Forwarder, path: str):
    async def endpoint(request: Request) -> Response:
        return await forward(request, path)

    return endpoint
