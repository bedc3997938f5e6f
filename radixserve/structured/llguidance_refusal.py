"""Where in the schema as given is the construct llguidance refused.

llguidance is given the schema as ``schema_rewrite`` rewrote it and ``llguidance_backend``
prepared it; its error message names a keyword, a pattern or a definition, not a path.
``refusal(where, message)`` finds the first schema object of the given document that the
message is about and names it by its path in the schema the request sent (``Where``: the
rewrite remembers where each of its objects came from), as an ``UnsupportedSchema``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from radixserve.structured.regex_support import pattern_problem
from radixserve.structured.schema_rewrite import SchemaRewrite
from radixserve.structured.schema_support import UnsupportedSchema
from radixserve.structured.schema_walk import join, subschemas

_KEYS = re.compile(r"Unimplemented keys: \[(.*)\]")


class Where:
    """Paths, in the schema as given, of the objects of the document llguidance is given
    (built from ``rewrite.result`` keeping its shape: the two are walked side by side)."""

    def __init__(self, given: Any, rewrite: SchemaRewrite):
        self.given, self._rewrite = given, rewrite
        self._paths = {id(s): p for s, p in subschemas(given)}
        pairs = zip(subschemas(given), subschemas(rewrite.result), strict=False)
        self._origin = {id(g): r for (g, _), (r, _) in pairs}

    def locate(self, node: Any, key: str) -> str | None:
        origin = self._origin.get(id(node))
        return None if origin is None else self._rewrite.locate(origin, key)

    def path(self, node: Any, key: str) -> str:
        found = self.locate(node, key)
        if found is not None:
            return found
        base = self._paths.get(id(node), "")
        return join(base, key) if base else key

    def find(self, keyword: Callable[[dict], str | None]) -> str:
        """The path of the first keyword ``keyword(node)`` names, else ``""``."""
        for node, _ in subschemas(self.given):
            key = keyword(node)
            if key is not None:
                return self.path(node, key)
        return ""


def refusal(where: Where, message: str) -> UnsupportedSchema:
    """``UnsupportedSchema`` at the construct llguidance's ``message`` is about."""
    first = message.strip().splitlines()[0]
    keys = _KEYS.search(first)
    if keys:
        names = json.loads(f"[{keys.group(1)}]")
        path = where.find(lambda s: next((k for k in names if k in s), None))
        key = (path or names[0]).rsplit(".", 1)[-1]
        return UnsupportedSchema(path, f"{key} is not supported")
    if first.startswith("regex parse error"):
        return _pattern_refusal(where, message)
    if first.startswith("oneOf constraints"):
        path = where.find(lambda s: "oneOf" if "oneOf" in s else None)
        return UnsupportedSchema(path, "oneOf whose branches may overlap is not supported (an "
                                 "output could match two)")  # fmt: skip
    if first.startswith("min/maxProperties"):
        path = where.find(_min_max)
        return UnsupportedSchema(path, "minProperties/maxProperties beside properties that are "
                                 "not all required is not supported")  # fmt: skip
    if first.startswith("Resource '"):
        target = first.split("'")[1]
        path = where.find(lambda s: "$ref" if _refers(s, target) else None)
        return UnsupportedSchema(path, f"a $ref to {target}, outside the schema, is not "
                                 "supported")  # fmt: skip
    if first.startswith("circular references with sibling keys"):
        pointer = first.rsplit("#", 1)[-1].strip("/")  # the definition referred to
        path = where.find(lambda s: "$ref" if _points_to(s, pointer) else None)
        return UnsupportedSchema(path, "a $ref with keywords beside it, in a cycle of "
                                 f"references to #/{pointer}, is not supported")  # fmt: skip
    return UnsupportedSchema("", first)


def _points_to(s: dict, pointer: str) -> bool:
    ref = s.get("$ref")
    beside = set(s) - {"$ref", "$defs", "definitions", "$schema", "$id", "id", "$comment",
                       "title", "description", "default", "examples"}  # fmt: skip
    return isinstance(ref, str) and ref.split("#")[-1].strip("/") == pointer and bool(beside)


def _pattern_refusal(where: Where, message: str) -> UnsupportedSchema:
    """At the pattern llguidance quotes (it may have rewritten ``\\d`` and ``\\w``), else at
    the first pattern with a construct ``pattern_problem`` names."""
    lines = message.strip().splitlines()
    quoted = lines[1].strip() if len(lines) > 1 else ""
    found = []
    for node, _ in subschemas(where.given):
        if isinstance(node.get("pattern"), str):
            found.append((where.path(node, "pattern"), node["pattern"]))
        if isinstance(node.get("patternProperties"), dict):
            base = where.path(node, "patternProperties")
            found += [(f"{base}.{p}", p) for p in node["patternProperties"]]
    for path, pattern in found:
        if pattern == quoted or pattern_problem(pattern):
            return UnsupportedSchema(path, pattern_problem(pattern) or lines[-1].strip())
    return UnsupportedSchema("", pattern_problem(quoted) or lines[-1].strip())


def _min_max(s: dict) -> str | None:
    return next((k for k in ("minProperties", "maxProperties") if k in s), None)


def _refers(s: dict, target: str) -> bool:
    ref = s.get("$ref")
    return isinstance(ref, str) and bool(ref.split("#")[0]) and target.endswith(ref.split("#")[0])
