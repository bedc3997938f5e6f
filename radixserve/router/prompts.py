"""From an HTTP request body to what the policy routes on: the prompt's token ids, hashed,
and a session key.

Tokenization is the server's own code: the same request models (``api/``) turn a body of
any of the chat APIs into the ``ChatInput`` the worker builds (tools included), and the same
``Tokenizer`` applies the chat template,
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

from radixserve.api.anthropic import CountTokensRequest, MessagesRequest
from radixserve.api.chat_input import ChatInput
from radixserve.api.guard import cache_namespace
from radixserve.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from radixserve.api.responses_api import ResponsesRequest
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


CHAT_BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}


def chat_input(path: str, body: dict[str, Any]) -> ChatInput | None:
    """The ``ChatInput`` the worker will build from a chat body (of any of the three APIs),
    or None for another path. A Responses body that continues a stored response is None:
    the conversation it extends is in one worker's store, not here."""
    if path in CHAT_BODIES:
        request = CHAT_BODIES[path](**body)
        return (
            request.to_chat_input({})
            if path != "/v1/chat/completions"
            else (request.chat_input({}))
        )
    if path == "/v1/responses" and body.get("previous_response_id") is None:
        return ResponsesRequest(**body).to_chat_input({}, [])[0]
    return None


def prompt_ids(path: str, body: dict[str, Any], tokenizer: Tokenizer) -> list[int] | None:
    """The token ids the worker will see first (the first prompt of a batch), or None when
    the worker will reject the body."""
    try:
        chat = chat_input(path, body)
        if chat is not None:
            ids = tokenizer.encode_chat(*chat.render(tokenizer.template_has_tools))
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


def session_key(headers: dict[str, str], body: dict[str, Any] | None) -> str | None:
    """What keeps a conversation on one worker: ``X-Session-Id``, else the body's own key:
    the Responses API's ``prompt_cache_key``, the Messages API's ``metadata.user_id``, or
    ``user``."""
    if SESSION_HEADER in headers:
        return headers[SESSION_HEADER]
    body = body or {}
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    for key in (body.get("prompt_cache_key"), user_id, body.get("user")):
        if isinstance(key, str):
            return key
    return None


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
    session = session_key(headers, body)
    if not ids:
        return RouteRequest((), 0, session)
    ns = namespace(body or {}, tenant)
    return RouteRequest(prompt_block_hashes(ids, block_size, ns), len(ids), session)
