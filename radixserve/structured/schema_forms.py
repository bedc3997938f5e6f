"""Equivalent forms of two constructs the grammar engine does not enforce as written.

- ``one_of_closed``: a ``oneOf`` of closed objects (``additionalProperties: false``) that
  differ only in what they require, as ``anyOf`` branches no value meets two of (the
  grammar compiles ``oneOf`` as ``anyOf``, so overlapping branches would let through a
  value that meets two).
- ``unique_arrays``: an array with ``uniqueItems`` whose items take a few listed values, as
  the list of every array it allows (for an ``enum``), at most ``UNIQUE_LIMIT`` of them.

- ``absent_keys``: ``not`` of ``required`` (some listed key is absent), as ``anyOf``
  branches each closing one key out (``properties: {k: false}``); ``not`` of an ``anyOf``
  of such (none of them holds) as the ``allOf`` of the parts.

- ``dependency_parts``: ``dependencies`` / ``dependentRequired`` / ``dependentSchemas``
  (where key ``k`` is present, the object requires more keys or meets a schema), as an
  ``anyOf`` per key: ``k`` closed out, or ``k`` required with what it brings.
  ``dependencies`` is taken as drafts 4 to 7 define it in every draft (from 2019-09 on it
  is no keyword, and meeting it only narrows what is written), and so are the later two.

Each returns None where its form does not apply; each is exact where it returns.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from radixserve.structured.schema_merge import assertions
from radixserve.structured.schema_types import expand, type_of, value_key

UNIQUE_LIMIT = 100
_ARRAY_KEYS = {"type", "uniqueItems", "items", "minItems", "maxItems"}


def one_of_closed(branches: list) -> list[tuple[dict, dict]] | None:
    """``anyOf`` branches for a ``oneOf`` of closed objects that differ only in what they
    require (None where that is not the case): branch i can hold alone only without the key
    each other branch j requires beyond it, so that key leaves branch i's properties (closed
    out); a branch another one implies cannot hold alone and goes. Each branch gets
    ``type: object``: a value of another type meets every branch, so ``oneOf`` refuses it."""
    shapes = set()
    for b in branches:
        if not (isinstance(b, dict) and b.get("additionalProperties") is False):
            return None
        required, props = b.get("required", []), b.get("properties", {})
        if "patternProperties" in b or not isinstance(props, dict):
            return None
        if not (isinstance(required, list) and all(isinstance(k, str) for k in required)):
            return None
        rest = {k: v for k, v in assertions(b).items() if k != "required"}
        if "type" in rest and "object" not in expand(rest["type"]):
            return None
        shapes.add(value_key(rest))
    if len(shapes) != 1 or len(branches) < 2:
        return None
    out = []
    for i, b in enumerate(branches):
        mine = set(b.get("required", []))
        extra = [set(o.get("required", [])) - mine for j, o in enumerate(branches) if j != i]
        if not all(extra):
            continue  # another branch holds wherever this one does
        gone = set().union(*(e for e in extra if len(e) == 1))
        if any(not e & gone for e in extra):
            return None  # "one of these keys absent": not one schema
        props = {k: v for k, v in b.get("properties", {}).items() if k not in gone}
        out.append((b, {**b, "type": "object", "properties": props}))
    return out


def unique_arrays(s: dict, items: Any) -> list[list] | None:
    """Every array ``s`` (``type: array`` with ``uniqueItems`` and no keyword but ``items``,
    ``minItems``, ``maxItems``) allows, given its ``items`` schema made flat (None where
    the items are not listed or the arrays are more than ``UNIQUE_LIMIT``)."""
    if "type" not in s or expand(s["type"]) != {"array"} or set(assertions(s)) - _ARRAY_KEYS:
        return None
    values = listed_values(items)
    if values is None:
        return None
    low, high = s.get("minItems", 0), s.get("maxItems", len(values))
    if not all(type(v) is int for v in (low, high)):
        return None
    high = min(high, len(values))
    if not 0 < sum(math.perm(len(values), k) for k in range(low, high + 1)) <= UNIQUE_LIMIT:
        return None
    return [list(p) for k in range(low, high + 1) for p in itertools.permutations(values, k)]


def absent_keys(n: Any) -> dict | None:
    """An equivalent of ``{"not": n}`` where ``n`` only requires keys (or is an ``anyOf`` of
    such), else None. ``required: []`` holds for every value, so its ``not`` holds for none."""
    if not isinstance(n, dict):
        return None
    keys = set(assertions(n))
    props = n.get("properties", {})
    if isinstance(props, dict) and all(v is True or v == {} for v in props.values()):
        keys.discard("properties")  # properties any value meets say nothing
    if keys == {"required"} and isinstance(n["required"], list) and n["required"]:
        if not all(isinstance(k, str) for k in n["required"]):
            return None
        branches = [{"properties": {k: False}} for k in dict.fromkeys(n["required"])]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    if keys == {"anyOf"} and isinstance(n["anyOf"], list) and n["anyOf"]:
        parts = [absent_keys(b) for b in n["anyOf"]]
        return None if any(p is None for p in parts) else {"allOf": parts}
    return None


DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")


def dependency_parts(s: dict) -> list[dict] | None:
    """``allOf`` parts equivalent to ``s``'s dependency keywords (None: none, or a form
    other than a list of key names or a schema)."""
    parts = []
    for keyword in DEPENDENCIES:
        deps = s.get(keyword)
        if deps is None:
            continue
        if not isinstance(deps, dict):
            return None
        for key, dep in deps.items():
            if isinstance(dep, list) and all(isinstance(k, str) for k in dep):
                holds: dict = {"required": [key, *dep]}
            elif isinstance(dep, dict | bool) and keyword != "dependentRequired":
                holds = {"allOf": [{"required": [key]}, dep]}
            else:
                return None
            parts.append({"anyOf": [{"properties": {key: False}}, holds]})
    return parts or None


def listed_values(flat: Any) -> list | None:
    """The distinct values a flat schema allows, where it lists them (``enum``, ``const``,
    or only booleans and null), else None."""
    if not isinstance(flat, dict):
        return None
    keys = set(assertions(flat))
    kinds = expand(flat["type"]) if "type" in flat else None
    if keys == {"type"} and kinds and kinds <= {"null", "boolean"}:
        values = [v for v in (None, False, True) if type_of(v) in kinds]
    elif keys in ({"enum"}, {"const"}, {"type", "enum"}, {"type", "const"}):
        values = flat["enum"] if "enum" in flat else [flat["const"]]
        if not isinstance(values, list):
            return None
        values = [v for v in values if kinds is None or type_of(v) in kinds]
    else:
        return None
    return list({value_key(v): v for v in values}.values())
