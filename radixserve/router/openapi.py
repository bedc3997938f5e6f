"""The router's OpenAPI document: its own routes, with the inference endpoints' request
bodies described by the server's request models (the router forwards the raw body, so
FastAPI cannot infer them), so that clients and schema fuzzers see what a worker accepts."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from radixserve.api.anthropic import CountTokensRequest, MessagesRequest
from radixserve.api.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixserve.api.responses_api import ResponsesRequest

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/generate": GenerateRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest,
}


def describe_bodies(app: FastAPI) -> None:
    """Make ``app.openapi()`` name the request model of each inference endpoint."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            refs, defs = models_json_schema(
                [(m, "validation") for m in BODIES.values()],
                ref_template="#/components/schemas/{model}",
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(defs.get("$defs", {}))
            for path, model in BODIES.items():
                content = {"application/json": {"schema": refs[(model, "validation")]}}
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": content,
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
