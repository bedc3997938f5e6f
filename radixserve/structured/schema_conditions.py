"""``if``/``then``/``else`` on a discriminator, as the ``anyOf`` of its cases.

An object that requires a key ``k`` whose own schema lists its values (an ``enum`` or
``const``), with conditions that each test only that key (``"if": {"properties": {"k":
{"const": "open"}}}``, in ``allOf`` parts or on the object itself), holds exactly when, for
the value ``v`` its ``k`` has, it meets ``k: const v``, the ``then`` of every condition ``v``
meets and the ``else`` of every other. ``discriminated(s)`` returns that ``anyOf`` (one branch
per listed value, each an ``allOf`` for ``schema_rewrite`` to merge) with the rest of ``s``,
or None where the form does not apply. It is exact: ``k`` is always present and always one
of the listed values, so every condition is decided by it.
"""

from __future__ import annotations

from typing import Any

from radixserve.structured.schema_forms import listed_values
from radixserve.structured.schema_merge import assertions
from radixserve.structured.schema_types import value_key

_CONDITION = {"if", "then", "else"}


def _tested(condition: Any) -> tuple[str, set[str]] | None:
    """The key an ``if`` tests and the value_keys of the values it holds for, else None."""
    if not isinstance(condition, dict):
        return None
    keys, props = set(assertions(condition)), condition.get("properties")
    if not (isinstance(props, dict) and len(props) == 1) or keys - {"properties", "required"}:
        return None
    [(k, test)] = props.items()
    if condition.get("required", [k]) != [k]:
        return None
    values = listed_values(test) if isinstance(test, dict) else None
    return None if values is None else (k, {value_key(v) for v in values})


def discriminated(s: dict) -> dict | None:
    """``s`` with its conditions on a discriminator as an ``allOf`` part holding the
    ``anyOf`` of its cases (see the module docstring), or None."""
    parts = s.get("allOf", [])
    if not isinstance(parts, list):
        return None
    conditions = [p for p in parts if isinstance(p, dict) and set(assertions(p)) <= _CONDITION]
    if "if" in s:
        conditions.append({k: s[k] for k in _CONDITION if k in s})
    if not conditions or any("if" not in c for c in conditions):
        return None
    tested = [_tested(c["if"]) for c in conditions]
    if any(t is None for t in tested) or len({t[0] for t in tested if t}) != 1:
        return None
    key = tested[0][0] if tested[0] else ""
    required, props = s.get("required", []), s.get("properties", {})
    if not (isinstance(required, list) and key in required and isinstance(props, dict)):
        return None
    values = listed_values(props.get(key))
    if not values:
        return None
    branches = []
    for v in values:
        chosen = [c.get("then" if value_key(v) in t[1] else "else", True)
                  for c, t in zip(conditions, tested, strict=True) if t]  # fmt: skip
        branches.append({"allOf": [{"properties": {key: {"const": v}}}, *chosen]})
    rest = {k: v for k, v in s.items() if k not in _CONDITION and k != "allOf"}
    others = [p for p in parts if not any(p is c for c in conditions)]
    return {**rest, "allOf": [*others, {"anyOf": branches}]}
