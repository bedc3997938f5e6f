"""The gate every HTTP request passes first: API keys, the admin key, the body size limit.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which hides a client's
disconnect from the handler, so a non-streaming request whose client left could not be
aborted). It answers itself, in the OpenAI error envelope, when a request is refused:
401 without a valid key (``Authorization: Bearer KEY``, or ``X-Api-Key: KEY`` as Anthropic's
clients send it; ``/health`` needs none), 403 on the admin paths without the admin
key, 413 for a body over the limit: by its ``Content-Length`` before a byte is read, or as
soon as a chunked body passes it. The request's tenant goes into ``scope["state"]``: the
caller's key's, or, from the holder of the admin key (a router in front), the tenant named in
``X-Radixserve-Tenant`` (anyone else's header is ignored). The router uses the same gate
with its own admin paths.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from fastapi import HTTPException

from radixserve.api.config import TENANT_HEADER, ServerConfig
from radixserve.api.errors import ApiError

OPEN_PATHS = ("/health",)
# /kv_events leads to a stream of every tenant's prompt token ids: as sensitive as the prompts
ADMIN_PATHS = ("/flush_cache", "/clear_kv_storage", "/cache", "/debug/", "/kv_events")


def key_tenant(key: str) -> str:
    """A stable, non-secret name for the holder of ``key``."""
    return hashlib.sha256(b"radixserve-tenant\0" + key.encode()).hexdigest()[:16]


def cache_namespace(tenant: str | None, salt: str | None) -> str | None:
    """The cache namespace (``RequestSpec.namespace``) of a tenant's salted request;
    None is the shared namespace. Hashed, so the salt never shows in ``/cache``."""
    if tenant is None and salt is None:
        return None
    material = f"{tenant or ''}\0{salt or ''}".encode()
    return "ns-" + hashlib.sha256(material).hexdigest()[:24]


class Guard:
    def __init__(self, app: Any, config: ServerConfig, admin_paths: tuple[str, ...] = ADMIN_PATHS):
        self.app, self.config, self.admin_paths = app, config, admin_paths
        self._keys = [(k.encode(), key_tenant(k)) for k in config.api_keys]
        self._admin = config.admin_key.encode() if config.admin_key else None

    def _who(self, headers: list[tuple[bytes, bytes]]) -> tuple[bool, bool, str | None]:
        """(a valid key was given, it is the admin key, the caller's tenant)."""
        given = next((v for k, v in headers if k == b"authorization"), b"")
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        if not token:  # Anthropic's clients send the key in X-Api-Key
            token = next((v for k, v in headers if k == b"x-api-key"), b"")
        if self._admin is not None and secrets.compare_digest(token, self._admin):
            return True, True, key_tenant(self.config.admin_key or "")
        valid = [tenant for key, tenant in self._keys if secrets.compare_digest(token, key)]
        return bool(valid), False, (valid[0] if valid else None)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], scope.get("headers", [])
        ok, admin, tenant = self._who(headers)
        refusal = None
        if self.config.auth_required and path not in OPEN_PATHS:
            if path.startswith(self.admin_paths) and not admin:
                refusal = (
                    ApiError(403, "this endpoint needs the admin key", kind="permission_error")
                    if self._admin is not None
                    else ApiError(
                        403,
                        "admin endpoints are closed: start the server with --admin-key",
                        kind="permission_error",
                    )
                )
            elif not ok:
                refusal = ApiError(401, "missing or wrong API key", kind="authentication_error")
        length = next((v for k, v in headers if k == b"content-length"), None)
        limit = int(self.config.max_request_bytes)
        if refusal is None and length is not None and (not length.isdigit() or int(length) > limit):
            refusal = _too_large(limit)
        if refusal is not None:
            return await refusal.response(path)(scope, receive, send)
        state = scope.setdefault("state", {})
        if admin:
            named = next((v for k, v in headers if k == TENANT_HEADER.encode()), None)
            tenant = named.decode("latin-1") if named else tenant
        state["tenant"] = tenant if self.config.salt_from_api_key else None
        state["caller"] = tenant  # whose stored responses (api/responses_api.py) it may read
        state["admin"] = admin
        await self.app(scope, _limited(receive, limit), send)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than the server's limit of {limit} bytes",
        kind="invalid_request_error",
    )


def _limited(receive: Any, limit: int) -> Any:
    seen = 0

    async def wrapped() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                # FastAPI passes an HTTPException raised while reading the body through
                raise HTTPException(413, _too_large(limit).message)
        return message

    return wrapped
