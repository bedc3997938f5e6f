"""What a JSON Schema allows, as far as the support check needs to know: the types an
instance can have, the values it lists, and whether two schemas exclude each other.

``SchemaTypes`` answers for the sub-schemas of one document, following its local ``$ref``s
(``#`` and ``#/...`` JSON pointers). Every answer is safe to act on: ``types`` may name a type
no instance has but never leaves one out, and ``exclusive`` says True only when it has proved
that no value is valid against both schemas.
"""

from __future__ import annotations

import json
import re
from typing import Any

ALL_TYPES = frozenset({"null", "boolean", "object", "array", "string", "integer", "number"})
_LEGACY = re.compile(r"draft-0[3-7]")
# the types of value each assertion or applicator keyword can apply to
APPLIES = {
    **dict.fromkeys(("minLength", "maxLength", "pattern"), frozenset({"string"})),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                     "multipleOf"), frozenset({"integer", "number"})),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "unevaluatedItems",
                     "minItems", "maxItems", "uniqueItems", "contains", "minContains",
                     "maxContains"), frozenset({"array"})),
    **dict.fromkeys(("properties", "required", "patternProperties", "additionalProperties",
                     "unevaluatedProperties", "propertyNames", "minProperties",
                     "maxProperties", "dependencies", "dependentRequired",
                     "dependentSchemas"), frozenset({"object"})),
    **dict.fromkeys(("type", "enum", "const", "allOf", "anyOf", "oneOf", "not",
                     "$ref", "$dynamicRef", "$recursiveRef"), ALL_TYPES),
}  # fmt: skip
# the keywords that constrain a value (every other keyword is an annotation or unknown)
ASSERTIONS = frozenset(APPLIES) | {"format", "if", "then", "else"}


def expand(kind: Any) -> frozenset[str]:
    """The types a ``type`` keyword allows (``number`` takes in ``integer``)."""
    names = kind if isinstance(kind, list) else [kind]
    out = {n for n in names if isinstance(n, str)}
    return frozenset(out | ({"integer"} if "number" in out else set()))


def type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def value_key(value: Any) -> str:
    """One spelling per JSON value (1 and 1.0 are the same number, true is not 1)."""

    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        return {k: norm(x) for k, x in v.items()} if isinstance(v, dict) else v

    return json.dumps(norm(value), sort_keys=True)


class SchemaTypes:
    """Answers about the sub-schemas of the document ``root``."""

    def __init__(self, root: Any):
        self.root = root
        uri = root.get("$schema") if isinstance(root, dict) else None
        # drafts up to 7 ignore the keywords beside a $ref
        self.legacy = isinstance(uri, str) and bool(_LEGACY.search(uri))

    def resolve(self, ref: Any) -> Any:
        """The sub-schema a local ``$ref`` points at (``LookupError`` saying why not)."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise LookupError(f"{ref!r} is not supported (only references inside the "
                              "schema, '#' or '#/...')")  # fmt: skip
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise LookupError(f"cannot resolve {ref!r}")
        return node

    def deref(self, s: Any) -> Any:
        """``s`` with its ``$ref``s followed (None where one does not resolve)."""
        for _ in range(32):
            if not (isinstance(s, dict) and "$ref" in s):
                return s
            try:
                s = self.resolve(s["$ref"])
            except LookupError:
                return None
        return None

    def types(self, s: Any, depth: int = 0) -> frozenset[str]:
        """Every type an instance valid against ``s`` can have (a superset)."""
        if not isinstance(s, dict) or depth > 32:
            return ALL_TYPES
        out = ALL_TYPES
        if "$ref" in s:
            out = self.types(self.deref(s), depth + 1)
            if self.legacy:
                return out
        if "type" in s:
            out &= expand(s["type"])
        if "const" in s:
            out &= {type_of(s["const"])}
        if isinstance(s.get("enum"), list):
            out &= {type_of(v) for v in s["enum"]}
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                out &= frozenset().union(*(self.types(b, depth + 1) for b in s[key]))
        for b in s["allOf"] if isinstance(s.get("allOf"), list) else []:
            out &= self.types(b, depth + 1)
        return out

    def finite(self, s: Any) -> set[str] | None:
        """The values ``s`` allows (``value_key``s), when it lists them (``const``/``enum``)."""
        s = self.deref(s)
        if isinstance(s, dict) and "const" in s:
            return {value_key(s["const"])}
        if isinstance(s, dict) and isinstance(s.get("enum"), list):
            return {value_key(v) for v in s["enum"]}
        return None

    def objects_only(self, s: Any) -> bool:
        """Whether the grammar compiled from ``s`` produces objects only: it has type
        ``object``, or no type and no other keyword before ``properties`` in the grammar
        compiler's order (xgrammar compiles such a schema as an object)."""
        if not isinstance(s, dict):
            return False
        if "type" in s or set(s) & {"$ref", "const", "enum", "anyOf", "oneOf", "allOf"}:
            return self.types(s) == {"object"}
        return bool(set(s) & {"properties", "additionalProperties", "unevaluatedProperties"})

    def exclusive(self, a: Any, b: Any) -> bool:
        """Whether no value the grammar produces for ``a`` is valid against ``b`` and the
        other way round (proved, else False): no common type, disjoint listed values, or two
        object schemas that confine a property one of them requires to disjoint listed values
        (a discriminator), or of which one requires a key the other closes out
        (``additionalProperties: false`` without it in ``properties``), or listed values
        none of which the other's ``pattern`` (on strings only) matches."""
        if not self.types(a) & self.types(b):
            return True
        va, vb = self.finite(a), self.finite(b)
        if va is not None and vb is not None and not va & vb:
            return True
        a, b = self.deref(a), self.deref(b)
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        if _missed(va, b) or _missed(vb, a):
            return True
        if not (self.objects_only(a) and self.objects_only(b)):
            return False
        props_a, props_b = a.get("properties"), b.get("properties")
        if not (isinstance(props_a, dict) and isinstance(props_b, dict)):
            return False
        required = {n for s in (a, b) for n in (s.get("required") or []) if isinstance(n, str)}
        for x, y, props in ((a, b, props_b), (b, a, props_a)):
            if y.get("additionalProperties") is False and "patternProperties" not in y:
                needs = {n for n in (x.get("required") or []) if isinstance(n, str)}
                if needs - set(props):
                    return True  # x requires a key that y closes out
        for name in required & set(props_a) & set(props_b):
            va, vb = self.finite(props_a[name]), self.finite(props_b[name])
            if va is not None and vb is not None and not va & vb:
                return True
        return False


def _missed(listed: set[str] | None, s: dict) -> bool:
    """Whether ``s`` allows strings only, under a ``pattern`` none of the ``listed`` values
    (``value_key``s, strings of ASCII only) matches. On ASCII text Python's ``re`` matches at
    least what ECMA-262 does (its ``\\s`` and ``$`` take more), so a miss is a proof."""
    pattern = s.get("pattern")
    if listed is None or not isinstance(pattern, str) or "type" not in s:
        return False
    if expand(s["type"]) != {"string"}:
        return False
    try:
        strings = [v for v in map(json.loads, listed) if isinstance(v, str)]
        if not all(v.isascii() for v in strings):
            return False
        found = [re.search(pattern, v) for v in strings]
    except re.error:
        return False
    return not any(found)
