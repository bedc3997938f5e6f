"""The sub-schemas of a JSON Schema document, with their paths, in document order.

A keyword's value is a schema, a list of schemas or a map of names to schemas depending on
the keyword; everything else (``enum``, ``const``, ``default``, ``examples``, ``required``,
unknown keywords) is data, never walked. ``subschemas`` yields every schema object of a
document (reachable or not) with its dotted path (``properties.tags.items``, ``allOf[1]``);
``find_keyword`` names the first that holds one of some keywords; ``map_schemas`` rebuilds a
document with a function applied to each schema object, bottom up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

# keywords whose value is one schema / a list of schemas / a map of names to schemas
ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames",
       "not", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties",
       "contentSchema")  # fmt: skip
MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
         "dependencies")  # fmt: skip


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and not key.startswith("[") else f"{path}{key}"


def _children(s: dict) -> Iterator[tuple[str, Any]]:
    """``(relative path, sub-schema)`` of one schema object, in its keys' order."""
    for key, value in s.items():
        if key in MANY and isinstance(value, list):
            for i, sub in enumerate(value):
                yield f"{key}[{i}]", sub
        elif key in ONE and isinstance(value, (dict, bool)):
            yield key, value
        elif key in NAMED and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, (dict, bool)):  # a list under dependencies is data
                    yield f"{key}.{name}", sub


def subschemas(schema: Any, path: str = "") -> Iterator[tuple[dict, str]]:
    """Every schema object of the document (depth first, in key order) with its path."""
    if not isinstance(schema, dict):
        return
    yield schema, path
    for rel, sub in _children(schema):
        yield from subschemas(sub, join(path, rel) if path else rel)


def find_keyword(schema: Any, keywords: Callable[[dict], str | None]) -> str | None:
    """The path (``a.b.keyword``) of the first keyword ``keywords(node)`` names, or None."""
    for node, path in subschemas(schema):
        key = keywords(node)
        if key is not None:
            return join(path, key) if path else key
    return None


def map_schemas(schema: Any, fn: Callable[[dict], dict]) -> Any:
    """A copy of the document with ``fn`` applied to each schema object (children first);
    ``fn`` returns a new dict and leaves its argument as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in MANY and isinstance(value, list):
            out[key] = [map_schemas(v, fn) for v in value]
        elif key in ONE and isinstance(value, dict):
            out[key] = map_schemas(value, fn)
        elif key in NAMED and isinstance(value, dict):
            out[key] = {n: map_schemas(v, fn) if isinstance(v, dict) else v
                        for n, v in value.items()}  # fmt: skip
    return fn(out)
