"""``if``/``then``/``else`` decided by one key's value, as the ``anyOf`` of its cases.

Conditions (in ``allOf`` parts or on the object itself, an ``else`` may be another
condition) that each test only one key ``k`` for a finite list of values (``"if":
{"properties": {"k": {"const": "open"}}}``, an ``enum``, an ``anyOf`` of such, ``type:
null``; maybe ``required: [k]``), on an object with a schema for ``k`` in its
``properties``, are decided by that key alone. So the object holds exactly
when, for the case its ``k`` falls in, it meets the ``then`` of every condition the case
makes true and the ``else`` of every other. The cases, which cover every object and never
two at once:

- each value ``k``'s own schema lists (an ``enum``/``const``), or, where it lists none, each
  tested value and "any other value" (``k`` matching ``regex_exclude.excluding``'s pattern
  of every string but the tested ones: every tested value must be a string);
- where ``k`` is not required, its absence (``properties: {k: false}``): a condition without
  ``required`` holds then, ``properties`` saying nothing of an absent key; the other cases
  then require ``k``.

``discriminated(s)`` returns ``s`` with the conditions replaced by an ``allOf`` part holding
the ``anyOf`` of the cases (each an ``allOf`` for ``schema_rewrite`` to merge), or None
where the form does not apply.
"""

from __future__ import annotations

from typing import Any

from radixserve.structured.regex_ast import RegexUnsupported
from radixserve.structured.regex_exclude import excluding
from radixserve.structured.schema_forms import listed_values
from radixserve.structured.schema_merge import assertions
from radixserve.structured.schema_types import value_key

_CONDITION = {"if", "then", "else"}
# the cases of a key that is not there, and of any untested value (value_keys are strings)
_ABSENT, _OTHER = ("absent",), ("other",)


def _values(test: Any) -> list | None:
    """The values a key's test holds for, where it lists them (``anyOf`` of lists too)."""
    if isinstance(test, dict) and set(assertions(test)) == {"anyOf"}:
        parts = [_values(b) for b in test["anyOf"]] if isinstance(test["anyOf"], list) else [None]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
    return listed_values(test)


def _tested(condition: Any) -> tuple[str, set, bool, list] | None:
    """The key an ``if`` tests, the value_keys it holds for, whether it requires the key,
    and those values; None where it tests anything else."""
    if not isinstance(condition, dict):
        return None
    keys, props = set(assertions(condition)), condition.get("properties")
    if not (isinstance(props, dict) and len(props) == 1) or keys - {"properties", "required"}:
        return None
    [(k, test)] = props.items()
    if condition.get("required", [k]) not in ([k], []):
        return None
    values = _values(test)
    if values is None:
        return None
    return k, {value_key(v) for v in values}, bool(condition.get("required")), values


def _is_condition(s: Any) -> bool:
    return isinstance(s, dict) and "if" in s and set(assertions(s)) <= _CONDITION


def _chosen(condition: dict, case: Any, key: str) -> list | None:
    """The schemas a condition applies in ``case`` (a value_key or ``_ABSENT``), following
    an ``else`` that is a condition on the same key; None where one is not decided by it."""
    tested = _tested(condition["if"])
    if tested is None or tested[0] != key:
        return None
    holds = not tested[2] if case == _ABSENT else case in tested[1]
    branch = condition.get("then" if holds else "else", True)
    return _chosen(branch, case, key) if _is_condition(branch) else [branch]


def _all_tested(condition: Any) -> list:
    """Every value the conditions in a chain of ``else``s test."""
    tested = _tested(condition.get("if")) if _is_condition(condition) else None
    if tested is None:
        return []
    return tested[3] + _all_tested(condition.get("else")) + _all_tested(condition.get("then"))


def discriminated(s: dict) -> dict | None:
    """``s`` with its conditions on one key as an ``allOf`` part holding the ``anyOf`` of its
    cases (see the module docstring), or None."""
    parts = s.get("allOf", [])
    if not isinstance(parts, list):
        return None
    conditions = [p for p in parts if _is_condition(p)]
    if "if" in s:
        conditions.append({k: s[k] for k in _CONDITION if k in s})
    if not conditions:
        return None
    first = _tested(conditions[0]["if"])
    required, props = s.get("required", []), s.get("properties", {})
    if first is None or not (isinstance(required, list) and isinstance(props, dict)):
        return None
    key = first[0]
    if key not in props:  # a bare condition (an else of another one): decided there
        return None
    cases = _cases(key, props.get(key), [v for c in conditions for v in _all_tested(c)])
    if cases is None:
        return None
    present = [] if key in required else [{"required": [key]}]
    if key not in required:
        cases.append((_ABSENT, {"properties": {key: False}}))
    branches = []
    for case, part in cases:
        chosen = [_chosen(c, case, key) for c in conditions]
        if any(c is None for c in chosen):
            return None
        given = [] if case == _ABSENT else present
        branches.append({"allOf": [*given, part, *(x for c in chosen if c for x in c)]})
    rest = {k: v for k, v in s.items() if k not in _CONDITION and k != "allOf"}
    others = [p for p in parts if not any(p is c for c in conditions)]
    return {**rest, "allOf": [*others, {"anyOf": branches}]}


def _cases(key: str, own: Any, tested: list) -> list[tuple[Any, dict]] | None:
    """(case, the schema of the key in that case) for a key whose schema is ``own``."""
    values = listed_values(own)
    if values:
        return [(value_key(v), {"properties": {key: {"const": v}}}) for v in values]
    words = list(dict.fromkeys(tested))
    if not words or not all(isinstance(w, str) for w in words):
        return None
    try:
        other = excluding(None, words)
    except RegexUnsupported:
        return None
    out = [(value_key(w), {"properties": {key: {"const": w}}}) for w in words]
    return [*out, (_OTHER, {"properties": {key: {"pattern": other}}})]
