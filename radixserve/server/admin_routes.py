"""The server's cache tools, metrics and debug endpoints (``/cache`` and ``/debug/`` are admin
paths: ``api/guard.py`` asks for the admin key there).

``/cache`` shows counts and hashes of the cached prefixes, their text only with
``debug_cache_text``: who sent what stays private; and the pins (``pin_routes.py``): their
budgets, totals, counters and the most recently used ones.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.api.config import ServerConfig
from radixserve.api.errors import ApiError, unavailable
from radixserve.engine.stats import EngineStats
from radixserve.links.keys import split_endpoint
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.engine_client import EngineClient, EngineDeadError
from radixserve.server.eviction_metrics import cache_eviction
from radixserve.server.metrics import Metrics
from radixserve.server.tier_metrics import cache_tiers


def add_admin_routes(
    app: FastAPI,
    client: EngineClient,
    tokenizer: Tokenizer,
    config: ServerConfig,
    metrics: Metrics,
) -> None:
    """``/flush_cache``, ``/clear_kv_storage``, ``/cache``, ``/kv_events``, ``/metrics``,
    ``/disagg/info`` and ``/debug/check_integrity``."""

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        """Drop every unlocked cached token from the device and host tiers."""
        return {"flushed_tokens": await engine_call(client, "flush_cache")}

    @app.post("/clear_kv_storage")
    async def clear_kv_storage() -> dict:
        """Delete this model's pages from the storage tier (other models' pages stay); 503
        when the store could not delete them (down, hung, read-only), so nothing claims it."""
        result = await engine_call(client, "clear_storage")
        if result is None:
            raise ApiError(400, "this server has no KV storage tier (see --kv-storage)")
        if not result.cleared:
            raise ApiError(503, f"the KV storage was not cleared: {result.reason}",
                           kind="server_error", headers={"Retry-After": "10"})  # fmt: skip
        return {"cleared": True}

    @app.get("/cache")
    async def cache(top: int = 10) -> dict:
        return await cache_listing(client, tokenizer, config.debug_cache_text, top)

    @app.get("/kv_events")
    async def kv_events() -> JSONResponse:
        """Where this server publishes KV events (for a router), or 404 when it does not."""
        info = client.info
        if not info.kv_events_endpoint:
            raise ApiError(404, "this server publishes no KV events (--kv-events-endpoint)")
        return JSONResponse(
            {
                "endpoint": info.kv_events_endpoint,
                "replay_endpoint": info.kv_events_replay_endpoint,
                # a subscriber expects this server key (links/keys.py); None: plain sockets
                "curve_public_key": _text(info.kv_events_public_key),
                "block_size": info.kv_events_block_size,
                "page_size": info.page_size,
                "format": "vllm",
            }
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/disagg/info")
    async def disagg_info() -> dict:
        """This instance's disaggregation role, KV layout, transfer endpoint and counters."""
        info = client.info.disaggregation
        if info is None:
            return {"mode": "off"}
        stats: EngineStats = await engine_call(client, "stats")
        return {
            "mode": info.mode,
            "endpoint": info.endpoint,  # with ?curve=KEY, its server key, under CurveZMQ
            "curve_public_key": _text(split_endpoint(info.endpoint or "")[1]),
            "layout": dataclasses.asdict(info.layout),
            "stats": dataclasses.asdict(stats.kv_transfer),
        }

    @app.get("/debug/check_integrity")
    async def check_integrity() -> dict:
        """Run the engine's slot-ownership check (free + cached + held == capacity)."""
        try:
            await engine_call(client, "check_integrity")
        except RuntimeError as e:
            raise ApiError(500, str(e), kind="server_error") from e
        return {"ok": True}


async def engine_call(client: EngineClient, name: str, **kwargs: object) -> object:
    """An engine RPC; a dead engine is a 503 the client should retry."""
    try:
        return await client.call(name, **kwargs)
    except EngineDeadError as e:
        raise unavailable(str(e)) from e


def _text(key: bytes | None) -> str | None:
    return key.decode() if key is not None else None


def token_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:16]


async def cache_listing(
    client: EngineClient, tokenizer: Tokenizer, show_text: bool, top: int
) -> dict:
    """``/cache``: the tree's size and its ``top`` largest prefixes, each by a digest of its
    first tokens (their text only with ``show_text``), and the pool's figures per tier."""
    summary = await engine_call(client, "cache_summary", top=min(max(top, 1), 100))
    prefixes = []
    for prefix in summary.top_prefixes:
        head = prefix.pop("head_token_ids")
        if show_text:
            prefixes.append(
                {**prefix, "head_text": tokenizer.decode(head, skip_special_tokens=False)}
            )
        else:  # who sent what stays private: a digest tells prefixes apart, nothing more
            prefixes.append({**prefix, "head_hash": token_digest(head)})
    stats: EngineStats = await engine_call(client, "stats")
    pins = None
    if stats.pins is not None:
        listed = await engine_call(client, "pin_listing")
        pins = {**dataclasses.asdict(stats.pins), "listed": [
            {"id": p.id, "tenant": p.tenant, "tokens": p.tokens, "expires_in": p.expires_in,
             "head_hash": token_digest(p.head_token_ids)} for p in listed[:top]]}  # fmt: skip
    return {
        "num_nodes": summary.num_nodes,
        "cached_tokens": summary.cached_tokens,
        "top_prefixes": prefixes,
        "capacity_tokens": stats.kv_capacity_tokens,
        "evictable_tokens": stats.evictable_tokens,
        "stats": dataclasses.asdict(stats.cache),
        "tiers": cache_tiers(stats),
        "pins": pins,
        "eviction": cache_eviction(stats),
    }
