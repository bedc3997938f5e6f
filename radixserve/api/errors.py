"""Every error the server and the router answer, in the envelope of the API called, with a
short message.

OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (and, on the Anthropic Messages
paths, Anthropic's ``{"type": "error", "error": {"type", "message"}}``) for every 4xx and 5xx:
our own
``ApiError``s, FastAPI's validation errors, Starlette's 404/405/400 (unknown route, wrong
method, a body that is not UTF-8), a dead or restarting engine (503 with ``Retry-After``) and
anything unexpected (500). Clients never see a traceback: it goes to the log.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("radixserve.server")

RETRY_AFTER_SECONDS = 2
ANTHROPIC_PATHS = ("/v1/messages",)  # errors there take Anthropic's shape
# Anthropic's error type of each status
_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            message,
            param,
            kind,
            code,
        )
        self.headers = headers

    def body(self, path: str = "") -> dict[str, Any]:
        """The error body in the shape of the API at ``path``."""
        if path.startswith(ANTHROPIC_PATHS):
            other = "api_error" if self.status >= 500 else self.kind
            kind = _ANTHROPIC_KINDS.get(self.status, other)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


def unavailable(message: str) -> ApiError:
    """503 that a client should retry: the engine is restarting or the queue is full."""
    return ApiError(
        503, message, kind="server_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
    )


_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def _from_http_exception(e: StarletteHTTPException) -> ApiError:
    message = e.detail if isinstance(e.detail, str) else "request failed"
    if e.status_code == 400 and "parsing the body" in message:
        message = "the body is not valid JSON in UTF-8"
    kind = _KINDS.get(e.status_code, "server_error" if e.status_code >= 500 else None)
    return ApiError(e.status_code, message, kind=kind or "invalid_request_error", headers=e.headers)


def _from_validation_error(e: RequestValidationError) -> ApiError:
    errors = e.errors() or [{"loc": (), "msg": "invalid request"}]
    field = errors[0].get("loc", ())[:2]  # ("body", the field)
    # a field that takes several shapes (a prompt as text or token ids) fails once per shape:
    # the failure of one of our own checks says more than "should be a valid string"
    same = [x for x in errors if x.get("loc", ())[:2] == field]
    ours = (x for x in same if x.get("type") == "value_error")
    # a list of typed blocks: the block's unknown or missing type says more than the other
    # shapes the field could have taken
    tags = (x for x in same if x.get("type") in ("union_tag_invalid", "union_tag_not_found"))
    # else the shape that got furthest (blocks sent for a text-or-blocks field: the block's
    # own field, not "should be a valid string")
    deepest = max(same or errors[:1], key=lambda x: len(x.get("loc", ())))
    err = next(ours, None) or next(tags, None) or deepest
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _shape_label(x)]
    param = loc[0] if loc else None  # the top-level field the client sent
    if err.get("type") == "json_invalid":
        message = f"the body is not valid JSON: {err.get('msg')}"
    elif not loc and err.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        message = "the body must be a JSON object (with Content-Type: application/json)"
    elif not loc and err.get("type") == "value_error" and "error" in err.get("ctx", {}):
        message = str(err["ctx"]["error"])  # a check of the whole body; it names the field
        param = message.split(" ")[0].split(".")[0]
    elif err.get("type") == "extra_forbidden":
        message = f"unsupported parameter {'.'.join(loc)!r}"
    else:
        message = f"invalid {'.'.join(loc) or 'body'}: {err.get('msg')}"
    return ApiError(400, message, param)


_SHAPE_LABELS = {"str", "int", "float", "bool", "list", "dict"}


def _shape_label(part: object) -> bool:
    """A step of a validation error's location that names one of a field's shapes (``str``,
    ``list[tagged-union[...]]``) rather than a field or an index."""
    return isinstance(part, str) and (part in _SHAPE_LABELS or "[" in part)


def install_error_handlers(app: FastAPI, retryable: tuple[type[Exception], ...] = ()) -> None:
    """Answer every error in the envelope; the ``retryable`` exceptions (a dead or restarting
    engine) as 503 with ``Retry-After``."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return _from_validation_error(e).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _from_http_exception(e).response(request.url.path)

    async def retry_later(request: Request, e: Exception) -> JSONResponse:
        return unavailable(str(e)).response(request.url.path)

    for kind in retryable:
        app.add_exception_handler(kind, retry_later)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=e)
        return internal_error().response(request.url.path)


def internal_error() -> ApiError:
    return ApiError(
        500, "internal server error; the details are in the server log", kind="server_error"
    )
