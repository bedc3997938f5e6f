"""The conjunction of two JSON Schemas as one schema, where that is exact.

``merge_flat(a, b, sub)`` returns the assertion keywords of one schema that accepts exactly
the values both ``a`` and ``b`` accept, or ``False`` when it has proved that no value does
(disjoint types, a ``const`` outside the other's ``enum``, a required property the other
closes out). It raises ``NotExact`` where one schema cannot say the same thing (two different
``pattern``s or ``format``s, ``prefixItems`` in one and ``items`` in the other, two
``contains``, a bound it cannot intersect, a ``false`` property the object does not close
out, ...): then the caller keeps the two schemas apart. ``a`` and ``b`` are *flat*: no
``$ref``, ``allOf``, ``anyOf`` or ``oneOf`` (the caller inlines and distributes those first).
``sub(x, y)`` merges two sub-schemas (a property both define, both ``items``) the same way.

Keywords only one side has are kept; those both have: ``type`` intersected (``number`` takes
in ``integer``), ``enum``/``const`` intersected, lower bounds the larger, upper bounds the
smaller, ``required`` the union, integer ``multipleOf`` their least common multiple, object
keywords per property (a property one side lacks meets that side's
``additionalProperties``), equal values kept, anything else ``NotExact``. Annotations
(``title``, ``description``, unknown keywords) are not the merge's business.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from radixserve.structured.schema_types import ASSERTIONS, expand, type_of, value_key

_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_OBJECT = ("properties", "patternProperties", "additionalProperties")
# keywords whose meaning depends on each other: both sides may have one only if equal
_GROUPS = (("items", "prefixItems", "additionalItems"), ("contains", "minContains",
           "maxContains"), ("if", "then", "else"))  # fmt: skip
_HANDLED = {"type", "enum", "const", "required", "propertyNames", "multipleOf", "uniqueItems",
            *_LOWER, *_UPPER, *_OBJECT, *(k for g in _GROUPS for k in g)}  # fmt: skip
Sub = Callable[[Any, Any], Any]


class NotExact(ValueError):
    """The two schemas have no exact merge."""


def assertions(s: dict) -> dict:
    return {k: v for k, v in s.items() if k in ASSERTIONS}


def merge_flat(a: dict, b: dict, sub: Sub) -> dict | bool:
    """One schema's assertion keywords for ``a`` and ``b`` both (see the module docstring)."""
    a, b = assertions(a), assertions(b)
    if any(not isinstance(s.get("required", []), list) for s in (a, b)):
        raise NotExact("a required that is not a list")  # draft 3
    out: dict = {k: v for k, v in a.items() if k not in b}
    out.update((k, v) for k, v in b.items() if k not in a)
    for k in set(a) & set(b) - _HANDLED:
        if value_key(a[k]) != value_key(b[k]):
            raise NotExact(f"two different {k}")
        out[k] = a[k]
    if "type" in a and "type" in b:
        kinds = expand(a["type"]) & expand(b["type"])
        if not kinds:
            return False
        kinds -= {"integer"} if "number" in kinds else set()
        out["type"] = next(iter(kinds)) if len(kinds) == 1 else sorted(kinds)
    if not _values(a, b, out) or not _object(a, b, out, sub):
        return False
    if "required" in a and "required" in b:
        out["required"] = list(dict.fromkeys([*a["required"], *b["required"]]))
    if "propertyNames" in a and "propertyNames" in b:
        out["propertyNames"] = sub(a["propertyNames"], b["propertyNames"])
    if a.get("uniqueItems") is True or b.get("uniqueItems") is True:
        out["uniqueItems"] = True
    _groups(a, b, out, sub)
    _bounds(a, b, out)
    return _closed_out(out)


def _values(a: dict, b: dict, out: dict) -> bool:
    """``const``/``enum``: the values both allow, of the merged type (False: none)."""
    listed = [s[k] if k == "enum" else [s[k]] for s in (a, b) for k in ("const", "enum")
              if k in s]  # fmt: skip
    if any(not isinstance(v, list) for v in listed):
        raise NotExact("an enum that is not a list")
    if not listed:
        return True
    kinds = expand(out["type"]) if "type" in out else None
    values = [v for v in listed[0] if kinds is None or type_of(v) in kinds]
    for other in listed[1:]:
        keys = {value_key(v) for v in other}
        values = [v for v in values if value_key(v) in keys]
    out.pop("enum", None), out.pop("const", None)
    if not values:
        return False
    if "const" in a or "const" in b:
        out["const"] = values[0]
    else:
        out["enum"] = list({value_key(v): v for v in values}.values())
    return True


def _trivial(s: Any) -> bool:
    return s is True or (isinstance(s, dict) and not assertions(s))


def _object(a: dict, b: dict, out: dict, sub: Sub) -> bool:
    """Properties, patternProperties and additionalProperties of both (False: none)."""
    if not any(k in a for k in _OBJECT) or not any(k in b for k in _OBJECT):
        return True  # one side has them all: kept as they are
    pa, pb = a.get("properties", {}), b.get("properties", {})
    ap_a, ap_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
    if not (isinstance(pa, dict) and isinstance(pb, dict)):
        raise NotExact("properties that are not an object")
    if "patternProperties" in a or "patternProperties" in b:
        if not (_trivial(ap_a) and _trivial(ap_b)):
            raise NotExact("patternProperties beside additionalProperties")
        pat_a, pat_b = a.get("patternProperties", {}), b.get("patternProperties", {})
        both = {p: sub(pat_a[p], pat_b[p]) for p in set(pat_a) & set(pat_b)}
        out["patternProperties"] = {**pat_a, **pat_b, **both}
    extra = True if _trivial(ap_a) and _trivial(ap_b) else sub(ap_a, ap_b)
    required = {*a.get("required", []), *b.get("required", [])}
    props = {}
    for name in dict.fromkeys([*pa, *pb]):
        merged = sub(pa.get(name, ap_a), pb.get(name, ap_b))
        if merged is not False:
            props[name] = merged
        elif name in required:
            return False
        elif extra is not False:
            props[name] = False  # the key must be absent (other keys may be written)
    out.pop("properties", None), out.pop("additionalProperties", None)
    if "properties" in a or "properties" in b:
        out["properties"] = props
    if extra is not True:
        out["additionalProperties"] = extra
    return True


def _groups(a: dict, b: dict, out: dict, sub: Sub) -> None:
    for group in _GROUPS:
        in_a = {k: a[k] for k in group if k in a}
        in_b = {k: b[k] for k in group if k in b}
        if not in_a or not in_b:
            continue
        if (
            set(in_a) == set(in_b) == {"items"}
            and not isinstance(a["items"], list)
            and (not isinstance(b["items"], list))
        ):
            out["items"] = sub(a["items"], b["items"])
        elif value_key(in_a) != value_key(in_b):
            raise NotExact(f"{' or '.join(group)} in both schemas")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bounds(a: dict, b: dict, out: dict) -> None:
    for keys, pick in ((_LOWER, max), (_UPPER, min)):
        for k in keys:
            if k in a and k in b and value_key(a[k]) != value_key(b[k]):
                if not (_num(a[k]) and _num(b[k])):
                    raise NotExact(f"two different {k}")  # a draft-4 boolean exclusive bound
                out[k] = pick(a[k], b[k])
    for plain, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        # draft 4: a boolean exclusive bound changes the meaning of the plain one beside it
        flags = [s.get(exclusive) for s in (a, b) if isinstance(s.get(exclusive), bool)]
        if (
            flags
            and plain in a
            and plain in b
            and value_key(a.get(exclusive)) != value_key(b.get(exclusive))
        ):
            raise NotExact(f"{plain} beside a boolean {exclusive}")
    step_a, step_b = a.get("multipleOf"), b.get("multipleOf")
    if "multipleOf" in a and "multipleOf" in b and step_a != step_b:
        if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                   for s in (step_a, step_b)):  # fmt: skip
            raise NotExact("two different multipleOf")
        out["multipleOf"] = math.lcm(step_a, step_b)
    elif "multipleOf" in a and "multipleOf" in b:
        out["multipleOf"] = step_a
    for low, high in zip(_LOWER, _UPPER, strict=True):
        if _num(out.get(low)) and _num(out.get(high)) and out[low] > out[high]:
            raise NotExact(f"{low} above {high}")


def _closed_out(out: dict) -> dict | bool:
    """False where a required property is one the object closes out."""
    if out.get("additionalProperties") is False and "patternProperties" not in out:
        props = out.get("properties")
        props = props if isinstance(props, dict) else {}
        if any(name not in props for name in out.get("required", [])):
            return False
    return out
