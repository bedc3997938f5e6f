"""From an HTTP request body to what the policy routes on: the prompt's token ids, hashed.

Tokenization is the server's own code: the same request models (``api/protocol.py``) turn
a body into a conversation or prompts, and the same ``Tokenizer`` applies the chat template,
so the router names exactly the blocks the worker will cache. A body that is not a JSON
object is the router's own 400; any other body the server would reject (token ids outside
the vocabulary, unknown fields...) routes with no prompt (by load alone), and the worker
answers with its 4xx, passed through. Tokenizing takes a while for a big body: callers run
``route_request`` off the event loop.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from radixserve.api.guard import cache_namespace
from radixserve.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.model.tokenizer import Tokenizer
from radixserve.router.policy import RouteRequest

SESSION_HEADER = "x-session-id"


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``; an ``ApiError`` (400) for anything else."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def prompt_ids(path: str, body: dict[str, Any], tokenizer: Tokenizer) -> list[int] | None:
    """The token ids the worker will see first (the first prompt of a batch), or None when
    the worker will reject the body."""
    try:
        if path == "/v1/chat/completions":
            ids = tokenizer.encode_chat(ChatCompletionRequest(**body).conversation())
        elif path == "/v1/completions":
            first = CompletionRequest(**body).prompts()[0]
            ids = tokenizer.encode(first) if isinstance(first, str) else list(first)
        elif path == "/generate" and isinstance(body.get("input_ids"), list):
            ids = body["input_ids"]
        elif path == "/generate" and isinstance(body.get("text"), str):
            ids = tokenizer.encode(body["text"])
        else:
            return None
    except (ValidationError, ApiError, ValueError, TypeError, OverflowError, RecursionError):
        return None
    vocab = tokenizer.vocab_size
    if not all(type(x) is int and 0 <= x < vocab for x in ids):
        return None  # the worker answers 400 for ids outside its vocabulary
    return ids


def namespace(body: dict[str, Any], tenant: str | None = None) -> str | None:
    """The cache namespace (engine ``namespace``) the worker will put this request in: the
    server's own rule (``guard.cache_namespace``) over the request's ``cache_salt`` and, when
    the workers run with ``--salt-from-api-key``, the caller's tenant."""
    salt = body.get("cache_salt")
    return cache_namespace(tenant, salt if isinstance(salt, str) else None)


def route_request(
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    tokenizer: Tokenizer,
    block_size: int,
    tenant: str | None = None,
) -> RouteRequest:
    """``tenant``: the caller's (``guard.key_tenant``) when the workers salt by key."""
    ids = prompt_ids(path, body, tokenizer) if body is not None else None
    session = headers.get(SESSION_HEADER)
    if session is None and body is not None and isinstance(body.get("user"), str):
        session = body["user"]
    if not ids:
        return RouteRequest((), 0, session)
    ns = namespace(body or {}, tenant)
    return RouteRequest(prompt_block_hashes(ids, block_size, ns), len(ids), session)
