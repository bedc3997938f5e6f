"""From an HTTP request body to what the policy routes on: the prompt's token ids, hashed.

Tokenization is the server's own code: the same request models (``server/protocol.py``) turn
a body into a conversation or prompts, and the same ``Tokenizer`` applies the chat template,
so the router names exactly the blocks the worker will cache. A body the server would reject
routes with no prompt (by load alone); the worker then answers with its 4xx, passed through.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.model.tokenizer import Tokenizer
from radixserve.router.policy import RouteRequest
from radixserve.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest

SESSION_HEADER = "x-session-id"


def parse_body(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def prompt_ids(path: str, body: dict[str, Any], tokenizer: Tokenizer) -> list[int] | None:
    """The token ids the worker will see first (the first prompt of a batch), or None."""
    try:
        if path == "/v1/chat/completions":
            return tokenizer.encode_chat(ChatCompletionRequest(**body).conversation())
        if path == "/v1/completions":
            first = CompletionRequest(**body).prompts()[0]
            return tokenizer.encode(first) if isinstance(first, str) else list(first)
        if path == "/generate":
            if isinstance(body.get("input_ids"), list):
                return [int(x) for x in body["input_ids"]]
            if isinstance(body.get("text"), str):
                return tokenizer.encode(body["text"])
    except (ValidationError, ApiError, ValueError, TypeError):
        return None
    return None


def namespace(body: dict[str, Any], headers: dict[str, str]) -> Any:
    """The cache namespace (engine ``extra_key``) the worker will put this request in.
    The server puts every request in the shared namespace."""
    return None


def route_request(
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    tokenizer: Tokenizer,
    block_size: int,
) -> RouteRequest:
    ids = prompt_ids(path, body, tokenizer) if body is not None else None
    session = headers.get(SESSION_HEADER)
    if session is None and body is not None and isinstance(body.get("user"), str):
        session = body["user"]
    if not ids:
        return RouteRequest((), 0, session)
    ns = namespace(body or {}, headers)
    return RouteRequest(prompt_block_hashes(ids, block_size, ns), len(ids), session)
