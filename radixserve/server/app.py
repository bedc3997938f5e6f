"""The FastAPI application: OpenAI endpoints, native ``/generate``, cache tools, metrics.

Errors always come back as OpenAI-style bodies: 400 for bad input (malformed JSON, wrong
types, unknown or unsupported parameters, prompts that do not fit), 401 without the API key,
404 for an unknown model, 503 when the engine is gone. With ``api_key`` set, every endpoint
but ``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import dataclasses
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.engine.stats import EngineStats
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.engine_client import EngineClient, EngineDeadError
from radixserve.server.metrics import Metrics
from radixserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from radixserve.server.responses import (
    ChatStream,
    CompletionStream,
    chat_response,
    completion_response,
)
from radixserve.server.serving import Job, Serving

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# On a decode instance: the prefill instance (its KV endpoint) to take the prompt's KV from;
# the router sets it per request (README: "Prefill/decode disaggregation").
PREFILL_HEADER = "x-radixserve-prefill"


def create_app(
    client: EngineClient, tokenizer: Tokenizer, served_model_name: str, api_key: str | None = None
) -> FastAPI:
    app = FastAPI(title="radixserve", version="0.1.0")
    metrics = Metrics(served_model_name, client.info)
    client.on_stats = metrics.update_stats
    serving = Serving(client, tokenizer, metrics)
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None  # the top-level field the client sent
        if err.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {err.get('msg')}"
        elif err.get("type") == "extra_forbidden":
            message = f"unsupported parameter {'.'.join(loc)!r}"
        else:
            message = f"invalid {'.'.join(loc) or 'body'}: {err.get('msg')}"
        return JSONResponse(ApiError(400, message, param).body(), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return JSONResponse(ApiError(503, str(e), kind="server_error").body(), status_code=503)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                error = ApiError(401, "missing or wrong API key", kind="authentication_error")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ApiError(
                404,
                f"model {name!r} not found; this server serves {served_model_name!r}",
                "model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> JSONResponse:
        if client.dead:
            return JSONResponse({"status": "error", "reason": client.dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": started,
                    "owned_by": "radixserve",
                    "max_model_len": client.info.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        params = body.choice_params()
        try:
            ids = tokenizer.encode_chat(body.conversation())
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from e
        job, queue = await serving.submit(
            "chatcmpl", [ids] * body.n, params, raw.headers.get(PREFILL_HEADER)
        )
        want_lp = body.logprobs
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            s = ChatStream(served_model_name, tokenizer, want_lp, include_usage)
            return StreamingResponse(
                serving.stream(job, queue, s.chunks, s.final),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        await serving.wait(job, queue, raw)
        return chat_response(job, served_model_name, tokenizer, want_lp)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        params = body.choice_params()
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in body.prompts()]
        ids = [p for p in prompts for _ in range(body.n)]
        job, queue = await serving.submit(
            "cmpl", ids, params * len(prompts), raw.headers.get(PREFILL_HEADER)
        )
        want_lp = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            s = CompletionStream(served_model_name, tokenizer, want_lp, include_usage, len(prompts))
            return StreamingResponse(
                serving.stream(job, queue, s.chunks, s.final),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        await serving.wait(job, queue, raw)
        return completion_response(job, served_model_name, tokenizer, want_lp, len(prompts))

    @app.post("/generate")
    async def generate(body: GenerateRequest, raw: Request):
        if (body.input_ids is None) == (body.text is None):
            raise ApiError(400, "give exactly one of input_ids and text", "input_ids")
        ids = body.input_ids if body.input_ids is not None else tokenizer.encode(body.text)
        job, queue = await serving.submit(
            "gen", [ids], [body.to_sampling_params()], raw.headers.get(PREFILL_HEADER)
        )
        if body.stream:
            return StreamingResponse(
                serving.stream(job, queue, native_chunks, lambda _: []),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        await serving.wait(job, queue, raw)
        return native_result(job, full=True)

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        return {"flushed_tokens": await client.call("flush_cache")}

    @app.get("/cache")
    async def cache(top: int = 10) -> dict:
        summary = await client.call("cache_summary", top=min(max(top, 1), 100))
        prefixes = []
        for prefix in summary.top_prefixes:
            head = prefix.pop("head_token_ids")
            prefixes.append(
                {**prefix, "head_text": tokenizer.decode(head, skip_special_tokens=False)}
            )
        stats: EngineStats = await client.call("stats")
        return {
            "num_nodes": summary.num_nodes,
            "cached_tokens": summary.cached_tokens,
            "top_prefixes": prefixes,
            "capacity_tokens": stats.kv_capacity_tokens,
            "evictable_tokens": stats.evictable_tokens,
            "stats": dataclasses.asdict(stats.cache),
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/disagg/info")
    async def disagg_info() -> dict:
        """This instance's disaggregation role, KV layout, transfer endpoint and counters."""
        info = client.info.disaggregation
        if info is None:
            return {"mode": "off"}
        stats: EngineStats = await client.call("stats")
        return {
            "mode": info.mode,
            "endpoint": info.endpoint,
            "layout": dataclasses.asdict(info.layout),
            "stats": dataclasses.asdict(stats.kv_transfer),
        }

    @app.get("/debug/check_integrity")
    async def check_integrity() -> dict:
        """Run the engine's slot-ownership check (free + cached + held == capacity)."""
        try:
            await client.call("check_integrity")
        except RuntimeError as e:
            raise ApiError(500, str(e), kind="server_error") from e
        return {"ok": True}

    return app


def native_result(job: Job, full: bool, index: int = 0) -> dict:
    t = job.trackers[index]
    if full:
        text, ids = t.text, t.token_ids
    else:
        text, ids, _ = t.take_stream_delta()
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": job.response_id,
            "prompt_tokens": len(job.prompts[index]),
            "cached_tokens": t.cached_tokens,
            "completion_tokens": len(t.token_ids),
            "finish_reason": t.finish_reason,
        },
    }


def native_chunks(job: Job, index: int) -> list[dict]:
    return [native_result(job, full=False, index=index)]
