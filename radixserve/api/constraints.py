"""Output constraints of a request body: ``response_format``, the grammar extensions and
``logit_bias``, turned into what the engine takes (a ``(kind, text)`` grammar, integer token
ids). Every grammar is checked here (``check_grammar``), so a bad one is a 400 naming the
problem before anything is queued, and so is a schema or regex with a construct the grammar
would not enforce: its message starts with the construct's path in the body
(``response_format.json_schema.schema.properties.id.pattern: ...``)."""

from __future__ import annotations

import json
from typing import Any

from radixserve.api.errors import ApiError
from radixserve.structured import UnsupportedSchema, check_grammar

# where each constraint field's grammar sits in the request body
_FIELD_PATH = {"response_format": "response_format.json_schema.schema"}


def response_format_grammar(fmt: dict[str, Any]) -> tuple[str, str]:
    """The grammar of a chat ``response_format`` other than ``{"type": "text"}``."""
    kind = fmt.get("type")
    if kind == "json_object" and set(fmt) == {"type"}:
        return grammar_from({"json_object": True})
    spec = fmt.get("json_schema")
    if kind != "json_schema" or set(fmt) != {"type", "json_schema"}:
        raise ApiError(400, "response_format must be {\"type\": \"text\"}, "
                       "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                       "\"json_schema\": {...}}", "response_format")  # fmt: skip
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ApiError(400, "response_format.json_schema must be an object with a schema",
                       "response_format")  # fmt: skip
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        name = sorted(unknown)[0]
        raise ApiError(400, f"response_format.json_schema: unknown field {name!r}",
                       "response_format")  # fmt: skip
    return grammar_from({"response_format": spec.get("schema", {"type": "object"})})


def unsupported_error(e: UnsupportedSchema, where: str, param: str) -> ApiError:
    """The 400 for a construct the grammar would not enforce, at ``where`` in the body."""
    return ApiError(400, f"{'.'.join(p for p in (where, e.path) if p)}: {e.detail}", param)


def parse_logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token id strings -> bias in [-100, 100]) with integer keys."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ApiError(400, "logit_bias must map token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()) and not isinstance(key, int):
            raise ApiError(400, f"logit_bias key {key!r} is not a token id", "logit_bias")
        out[int(key)] = value
    return out


def grammar_from(given: dict[str, Any], prefix: str = "") -> tuple[str, str] | None:
    """``(kind, text)`` from the one constraint field given (400 for several or a bad one;
    ``prefix``: where the fields sit in the body, such as ``sampling_params.``)."""
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise ApiError(400, f"give at most one of {', '.join(given)}", next(iter(given)))
    if not given:
        return None
    ((name, value),) = given.items()
    if name in ("json_schema", "response_format") and not isinstance(value, str):
        value = json.dumps(value)
    kind = "json_schema" if name in ("json_schema", "response_format") else name
    if name == "json_object":
        kind, value = "json_object", ""
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", name)
    try:
        check_grammar(kind, value)
    except UnsupportedSchema as e:
        raise unsupported_error(e, prefix + _FIELD_PATH.get(name, name), name) from e
    except ValueError as e:
        raise ApiError(400, f"{name}: {e}", name) from e
    return kind, value


def schema_grammar(schema: Any, where: str, param: str) -> tuple[str, str]:
    """The grammar of an output format's JSON Schema at ``where`` in the body (the Messages
    and Responses APIs' ``format`` objects), checked like every other."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{where} must be a JSON Schema object", param)
    text = json.dumps(schema)
    try:
        check_grammar("json_schema", text)
    except UnsupportedSchema as e:
        raise unsupported_error(e, where, param) from e
    except ValueError as e:
        raise ApiError(400, f"{where}: {e}", param) from e
    return "json_schema", text
