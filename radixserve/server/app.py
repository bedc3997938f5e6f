"""The FastAPI application: OpenAI endpoints, native ``/generate``, and (``admin_routes.py``)
cache tools and metrics.

Errors always come back as OpenAI-style bodies (``api/errors.py``): 400 for bad input (malformed
JSON, wrong types, unknown or unsupported parameters, prompts that do not fit), 401/403
without the right key (``api/guard.py``), 404 for an unknown model or route, 413 for a body over
the limit, 503 with ``Retry-After`` while the engine restarts or the queue is full.
A request's ``cache_salt`` (and, with ``salt_from_api_key``, its key)
selects its cache namespace, so tenants never share cached tokens or their timing.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve.api.config import ServerConfig
from radixserve.api.errors import ApiError, install_error_handlers
from radixserve.api.guard import Guard
from radixserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from radixserve.model.generation_defaults import GenerationDefaults
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.admin_routes import add_admin_routes
from radixserve.server.chat_run import check_model, request_spec, sse_response, start
from radixserve.server.engine_client import EngineClient, EngineDeadError
from radixserve.server.messages_api import add_messages_routes
from radixserve.server.metrics import Metrics
from radixserve.server.prefill_trust import PrefillTrust
from radixserve.server.responses import (
    ChatStream,
    CompletionStream,
    chat_response,
    completion_response,
)
from radixserve.server.responses_api import add_responses_routes
from radixserve.server.segments import encode_chat_segments, encode_segments
from radixserve.server.serving import Job, Serving


def create_app(
    client: EngineClient,
    tokenizer: Tokenizer,
    config: ServerConfig,
    sampling: GenerationDefaults | None = None,
) -> FastAPI:
    served_model_name = config.served_model_name or "model"
    sampling = sampling or GenerationDefaults()
    app = FastAPI(title="radixserve", version="0.1.0")
    metrics = Metrics(served_model_name, client.info, lambda: client.num_restarts)
    client.on_stats = metrics.update_stats
    serving = Serving(
        client, tokenizer, metrics, config, client.config.scheduler.max_running_requests
    )
    app.add_middleware(Guard, config=config)
    install_error_handlers(app, retryable=(EngineDeadError,))
    app.state.serving = serving  # the server closes its tokenizer thread on the way out
    app.state.prefill_trust = PrefillTrust(client.config.disagg, config.trusted_prefill)
    add_info_routes(app, client, served_model_name, sampling)
    add_openai_routes(app, serving, tokenizer, served_model_name, sampling.values)
    add_messages_routes(app, serving, tokenizer, served_model_name, sampling.values)
    add_responses_routes(app, serving, tokenizer, served_model_name, sampling.values)
    add_generate_route(app, serving, tokenizer, sampling.values)
    add_admin_routes(app, client, tokenizer, config, metrics)
    return app


def add_openai_routes(
    app: FastAPI,
    serving: Serving,
    tokenizer: Tokenizer,
    served_model_name: str,
    defaults: dict[str, Any],
) -> None:
    """``/v1/chat/completions`` and ``/v1/completions``."""

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_model(body.model, served_model_name)
        reusable = body.reusable_parts()
        chat = await serving.checked(lambda: body.chat_input(defaults, bool(reusable)))
        serving.check_size(body.n)
        if reusable:  # RAG segments (server/segments.py)
            if chat.plan is not None:
                raise ApiError(400, "tools cannot be combined with reusable content parts",
                               "tools")  # fmt: skip
            marked, _ = chat.render(tokenizer.template_has_tools)
            ids, ranges = await serving.off_loop(encode_chat_segments, tokenizer, marked, reusable)
            options = {"segments": tuple(ranges), "recompute_ratio": body.recompute_ratio}
            spec = request_spec(raw, body.cache_salt, grammar=chat.grammar, **options)
            job, queue = await serving.submit("chatcmpl", [ids] * body.n, chat.params, spec)
        else:
            job, queue = await start(serving, tokenizer, chat, raw, "chatcmpl")
        want_lp = body.logprobs
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            s = ChatStream(served_model_name, tokenizer, want_lp, include_usage, tools=chat.plan)
            return sse_response(serving.stream(job, queue, s.chunks, s.final))
        await serving.wait(job, queue, raw)
        return chat_response(job, served_model_name, tokenizer, want_lp, chat.plan)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model, served_model_name)
        params = body.choice_params(defaults)
        serving.check_size(len(body.prompts()) * body.n, "prompt")
        prompts = await serving.off_loop(encode_prompts, tokenizer, body.prompts())
        ids = [p for p in prompts for _ in range(body.n)]
        spec = request_spec(raw, body.cache_salt, grammar=await serving.checked(body.grammar))
        job, queue = await serving.submit("cmpl", ids, params * len(prompts), spec)
        want_lp = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            s = CompletionStream(served_model_name, tokenizer, want_lp, include_usage, len(prompts))
            return sse_response(serving.stream(job, queue, s.chunks, s.final))
        await serving.wait(job, queue, raw)
        return completion_response(job, served_model_name, tokenizer, want_lp, len(prompts))


def add_generate_route(
    app: FastAPI, serving: Serving, tokenizer: Tokenizer, defaults: dict[str, Any]
) -> None:
    """The native ``/generate``: token ids, text or RAG segments in, SGLang's response shape."""

    @app.post("/generate")
    async def generate(body: GenerateRequest, raw: Request):
        params = body.to_sampling_params(defaults)
        options: dict = {"grammar": await serving.checked(body.grammar)}
        if body.input_ids is not None:
            ids = body.input_ids
        elif body.text is not None:
            ids = await serving.off_loop(tokenizer.encode, body.text)
        else:
            ids, ranges = await serving.off_loop(encode_segments, tokenizer, body.segments)
            options = {"segments": tuple(ranges), "recompute_ratio": body.recompute_ratio}
        spec = request_spec(raw, body.cache_salt, **options)
        job, queue = await serving.submit("gen", [ids], [params], spec)
        if body.stream:
            return sse_response(serving.stream(job, queue, native_chunks, lambda _: []))
        await serving.wait(job, queue, raw)
        return native_result(job, full=True)


def add_info_routes(
    app: FastAPI, client: EngineClient, served_model_name: str, sampling: GenerationDefaults
) -> None:
    """``/health`` and ``/v1/models``."""
    started = int(time.time())

    @app.get("/health")
    async def health() -> JSONResponse:
        if client.ready:
            return JSONResponse({"status": "ok"})
        reason = client.dead or f"the engine is {client.state}"
        headers = None if client.dead else {"Retry-After": "2"}
        return JSONResponse(
            {"status": client.state, "reason": reason}, status_code=503, headers=headers
        )

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
                    "default_sampling": sampling.values,
                    "default_sampling_source": sampling.source,
                }
            ],
        }


def encode_prompts(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]


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
            "cached_tokens": t.usage.cached_tokens,
            "cached_tokens_by_tier": t.usage.cached_by_tier(),
            **t.usage.segment_usage(),
            "completion_tokens": len(t.token_ids),
            "finish_reason": t.finish_reason,
        },
    }


def native_chunks(job: Job, index: int) -> list[dict]:
    return [native_result(job, full=False, index=index)]
