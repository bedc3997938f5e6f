"""The JSON Schema constructs the grammar engine enforces exactly, and a check that refuses
the others.

xgrammar 0.2.9 compiles a schema by picking one keyword per schema object, in this order:
``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf``, ``allOf``, ``type``, then ``properties``
/ ``items`` (an object / array), else any JSON value. Other assertion keywords of that object
are dropped, and so are some keywords it cannot express (it logs a warning, or nothing):

- beside ``$ref``, ``const``, ``enum`` or a combinator: every other keyword (harmless where
  it cannot apply to what the chosen keyword produces; beside ``$ref`` in drafts up to 7,
  where the specification ignores them too);
- ``allOf`` with several schemas (any JSON value), ``oneOf`` whose branches may overlap
  (compiled as ``anyOf``), ``not``, ``if``/``then``/``else``, ``dependencies``,
  ``dependentRequired``, ``dependentSchemas``, ``contains``, ``uniqueItems``, ``$ref``
  outside the document, ``$dynamicRef``, ``$recursiveRef``;
- a ``required`` property not in ``properties``; a property also matched by a
  ``patternProperties`` pattern or not allowed by ``propertyNames``; ``minProperties``
  that two or more keys matched by ``additionalProperties`` / ``patternProperties`` must
  meet (such a key may repeat);
- ``minLength`` / ``maxLength`` beside a ``pattern`` or a format it knows, a ``pattern``
  beside such a format, ``multipleOf`` on numbers, and on integers when it is not a whole
  number, over 1024, or with a one-sided or wider-than-10,000 range;
- in a pattern: lookaheads, and ``^`` / ``$`` anywhere but the start / end of the pattern or
  of a top-level alternative;
- assertion keywords of a schema without a type that the grammar compiles as any value.

So an output could follow the grammar and still break the schema. The grammar compiler
compiles ``rewrite_schema(schema)`` (``schema_rewrite``: ``allOf``, ``$ref`` with keywords
beside it, keywords beside ``anyOf``/``oneOf`` and some ``uniqueItems`` rewritten into the
forms above, where that is exact), and ``check_schema_support`` walks that rewritten schema
from its root (following local ``$ref``s, so unused definitions do not count) and raises
``UnsupportedSchema`` naming the JSON path (in the schema as given) and the keyword of the
first such construct. A ``oneOf`` whose branches are provably exclusive (no common type,
disjoint ``const``/``enum`` values, or a property required by one side whose values the two
sides confine to disjoint sets) is exact as ``anyOf`` and accepted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from radixserve.structured.regex_support import pattern_problem
from radixserve.structured.schema_rewrite import SchemaRewrite
from radixserve.structured.schema_types import (
    ALL_TYPES,
    APPLIES,
    SchemaTypes,
    expand,
    type_of,
    value_key,
)

_NEVER = ("not", "$dynamicRef", "$recursiveRef", "dependencies", "dependentRequired",
          "dependentSchemas", "contains")  # fmt: skip
# the formats xgrammar 0.2.9 turns into a regex (others are left as any string)
KNOWN_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6",
                           "hostname", "uuid", "uri", "uri-reference", "uri-template",
                           "json-pointer", "relative-json-pointer"})  # fmt: skip
_INT_MULTIPLE_MAX, _INT_RANGE_MAX = 1024, 10_000


class UnsupportedSchema(ValueError):
    """A schema construct the grammar would not enforce, at ``path`` (dotted, from the
    schema's root; empty for the root itself)."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"{path}: {detail}" if path else detail)
        self.path, self.detail = path, detail


def check_schema_support(schema: Any, rewrite: SchemaRewrite | None = None) -> None:
    """Raise ``UnsupportedSchema`` for the first construct the grammar would not enforce in
    ``rewrite.result`` (default ``SchemaRewrite(schema)``: the rewrite of ``schema``), named
    by its path in ``schema``."""
    rewrite = SchemaRewrite(schema) if rewrite is None else rewrite
    _Walk(rewrite.result, rewrite.locate).node(rewrite.result, "")


def _join(path: str, *parts: str) -> str:
    return ".".join(p for p in (path, *parts) if p)


class _Walk:
    def __init__(self, root: Any, locate: Callable[[Any, str], str | None]):
        self.schema = SchemaTypes(root)
        self.locate = locate  # where a node (or a key of it) of root was in the original
        self.seen = {"#"}  # the root is walked first

    def at(self, s: dict, path: str, key: str, *rest: str) -> str:
        """The original path of ``key`` of ``s`` (then ``rest``), else ``path.key``."""
        found = self.locate(s, key)
        return _join(_join(path, key) if found is None else found, *rest)

    def node(self, s: Any, path: str, default_type: str | None = None) -> None:
        if not isinstance(s, dict):
            return  # true, or something the grammar compiler refuses itself
        found = self.locate(s, "")
        path = path if found is None else found
        for key in _NEVER:
            if key not in s or (key.startswith("depend") and not s[key]):
                continue  # no dependencies listed: nothing dropped
            if APPLIES[key] & self.schema.types(s):  # else it cannot apply to the value
                raise UnsupportedSchema(self.at(s, path, key), f"{key} is not supported")
        if "if" in s and ("then" in s or "else" in s):
            raise UnsupportedSchema(self.at(s, path, "if"), "if/then/else is not supported")
        chosen = next((k for k in ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
                       if k in s), None)  # fmt: skip
        if chosen == "$ref":
            self.reference(s, path)
        elif chosen in ("const", "enum"):
            self.values(s, path, chosen)
        elif chosen is not None:
            self.combinator(s, path, chosen)
        elif "type" in s and expand(s["type"]):
            for kind in sorted(expand(s["type"])):
                self.typed(s, path, kind)
        elif {"properties", "additionalProperties", "unevaluatedProperties"} & set(s):
            self.typed(s, path, "object")
        elif {"items", "prefixItems", "unevaluatedItems"} & set(s):
            self.typed(s, path, "array")
        elif default_type is not None:
            self.typed(s, path, default_type)
        else:
            self.siblings(s, path, None, ALL_TYPES, "without a type (any JSON value there)")

    def siblings(self, s: dict, path: str, chosen: str | None, produced: frozenset[str],
                 why: str) -> None:  # fmt: skip
        """Refuse the keywords beside ``chosen`` that could apply to what it produces."""
        for key in s:
            if key == chosen or not (APPLIES.get(key, frozenset()) & produced):
                continue
            if key == "type" and produced <= expand(s["type"]):
                continue  # what the chosen keyword produces has that type already
            raise UnsupportedSchema(self.at(s, path, key), f"{key} {why} is not supported")

    def reference(self, s: dict, path: str) -> None:
        try:
            target = self.schema.resolve(s["$ref"])
        except LookupError as e:
            raise UnsupportedSchema(self.at(s, path, "$ref"), str(e)) from e
        if not self.schema.legacy:  # drafts up to 7 ignore the keywords beside $ref themselves
            self.siblings(s, path, "$ref", self.schema.types(target), "beside $ref")
        if s["$ref"] not in self.seen:
            self.seen.add(s["$ref"])
            self.node(target, s["$ref"].lstrip("#/").replace("/", ".") or "#")

    def values(self, s: dict, path: str, chosen: str) -> None:
        values = [s["const"]] if chosen == "const" else s["enum"]
        if not isinstance(values, list):
            return  # the grammar compiler refuses it itself
        if "type" in s and any(type_of(v) not in expand(s["type"]) for v in values):
            raise UnsupportedSchema(self.at(s, path, chosen), f"a value of {chosen} is not of the "
                                    f"type {s['type']!r} beside it")  # fmt: skip
        if chosen == "const" and isinstance(s.get("enum"), list):
            if value_key(s["const"]) not in {value_key(v) for v in s["enum"]}:
                raise UnsupportedSchema(self.at(s, path, "const"), "the const value is not in enum")
        rest = {k: v for k, v in s.items() if k not in ("type", "enum")}
        self.siblings(rest, path, chosen, frozenset(map(type_of, values)), f"beside {chosen}")

    def combinator(self, s: dict, path: str, chosen: str) -> None:
        branches = s[chosen]
        if not isinstance(branches, list):
            return  # the grammar compiler refuses it itself
        if chosen == "allOf" and len(branches) > 1:
            if any(isinstance(b, dict) and set(b) & set(APPLIES) for b in branches):
                raise UnsupportedSchema(self.at(s, path, "allOf"),
                                        "allOf with several schemas is not supported")  # fmt: skip
        produced = (
            frozenset().union(*(self.schema.types(b) for b in branches)) if branches else ALL_TYPES
        )
        self.siblings(s, path, chosen, produced, f"beside {chosen}")
        for i, b in enumerate(branches):
            self.node(b, _join(path, f"{chosen}[{i}]"))
        if chosen == "oneOf":
            for i, a in enumerate(branches):
                for j in range(i + 1, len(branches)):
                    if not self.schema.exclusive(a, branches[j]):
                        raise UnsupportedSchema(self.at(s, path, "oneOf"), f"oneOf whose branches "
                                                f"{i} and {j} may overlap is not supported "
                                                "(an output could match both)")  # fmt: skip

    def typed(self, s: dict, path: str, kind: str) -> None:
        if kind == "string":
            self.string(s, path)
        elif kind in ("integer", "number"):
            self.number(s, path, kind)
        elif kind == "array":
            self.array(s, path)
        elif kind == "object":
            self.object(s, path)

    def string(self, s: dict, path: str) -> None:
        pattern, fmt = s.get("pattern"), s.get("format")
        known_format = fmt in KNOWN_FORMATS
        if isinstance(pattern, str):
            if known_format:
                detail = f"pattern beside format {fmt!r} is not supported"
                raise UnsupportedSchema(self.at(s, path, "pattern"), detail)
            problem = pattern_problem(pattern)
            if problem:
                raise UnsupportedSchema(self.at(s, path, "pattern"), problem)
        if known_format or isinstance(pattern, str):
            beside = f"format {fmt!r}" if known_format else "pattern"
            for key in ("minLength", "maxLength"):
                if key in s and not (key == "minLength" and s[key] == 0):
                    raise UnsupportedSchema(self.at(s, path, key),
                                            f"{key} beside {beside} is not supported")  # fmt: skip

    def number(self, s: dict, path: str, kind: str) -> None:
        step = s.get("multipleOf")
        if not isinstance(step, (int, float)) or isinstance(step, bool) or step == 1:
            return
        where = self.at(s, path, "multipleOf")
        if kind == "number" or float(step) != int(step) or step > _INT_MULTIPLE_MAX:
            raise UnsupportedSchema(where, f"multipleOf {step} on type {kind} is not supported")
        low = [v for v in (s.get("minimum"), _plus(s.get("exclusiveMinimum"), 1)) if _num(v)]
        high = [v for v in (s.get("maximum"), _plus(s.get("exclusiveMaximum"), -1)) if _num(v)]
        if (low or high) and not (low and high and min(high) - max(low) < _INT_RANGE_MAX):
            raise UnsupportedSchema(where, "multipleOf with a one-sided or wider than "
                                    f"{_INT_RANGE_MAX} range is not supported")  # fmt: skip

    def array(self, s: dict, path: str) -> None:
        if s.get("uniqueItems") is True and not (_num(s.get("maxItems")) and s["maxItems"] <= 1):
            raise UnsupportedSchema(self.at(s, path, "uniqueItems"), "uniqueItems is not supported")
        if isinstance(s.get("items"), dict):
            self.node(s["items"], _join(path, "items"))
        elif "items" not in s and isinstance(s.get("unevaluatedItems"), dict):
            self.node(s["unevaluatedItems"], _join(path, "unevaluatedItems"))
        for i, item in enumerate(s.get("prefixItems") or []):
            self.node(item, _join(path, f"prefixItems[{i}]"))

    def object(self, s: dict, path: str) -> None:
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        if repeated_keys_problem(s):
            raise UnsupportedSchema(self.at(s, path, "minProperties"), repeated_keys_problem(s))
        for name in s.get("required") or []:
            if name not in props:
                raise UnsupportedSchema(self.at(s, path, "required"), f"required property {name!r} "
                                        "that is not in properties is not supported")  # fmt: skip
        patterns = s.get("patternProperties")
        for pattern, sub in patterns.items() if isinstance(patterns, dict) else []:
            where = self.at(s, path, "patternProperties", pattern)
            problem = pattern_problem(pattern)
            if problem:
                raise UnsupportedSchema(where, problem)
            clash = [n for n in props if _search(pattern, n)]
            if clash:
                raise UnsupportedSchema(where, f"a pattern property that matches the property "
                                        f"{clash[0]!r} is not supported")  # fmt: skip
            self.node(sub, where)
        if "propertyNames" in s:
            self.property_names(s["propertyNames"], props, self.at(s, path, "propertyNames"))
        for name, sub in props.items():
            self.node(sub, _join(path, "properties", name))
        for key in ("additionalProperties", "unevaluatedProperties"):
            if isinstance(s.get(key), dict):
                self.node(s[key], _join(path, key))
                break
            if key in s:
                break

    def property_names(self, names: Any, props: dict, path: str) -> None:
        self.node(names, path, default_type="string")
        if not props or not isinstance(names, dict):
            return
        kept = {k for k in names if k in APPLIES} - {"type", "pattern", "minLength",
                                                      "maxLength", "enum", "const"}  # fmt: skip
        for name in props:
            if kept or not _name_fits(name, names):
                raise UnsupportedSchema(path, "propertyNames that the listed property "
                                        f"{name!r} may not meet is not supported")  # fmt: skip


def repeated_keys_problem(s: dict) -> str | None:
    """Why ``minProperties`` of ``s`` is not enforced, or None: both grammar engines let a
    key matched by ``additionalProperties`` / ``patternProperties`` repeat (``{"a": 1, "a":
    2}``), which counts once once parsed, so a minimum two or more such keys must meet is
    not enforced."""
    low, props = s.get("minProperties"), s.get("properties")
    names = props if isinstance(props, dict) else {}
    required = {n for n in s.get("required") or [] if isinstance(n, str) and n in names}
    closed = s.get("additionalProperties") is False and not s.get("patternProperties")
    if _num(low) and not closed and low - len(required) >= 2:
        return (
            "minProperties that keys matched by additionalProperties or patternProperties "
            "must meet is not supported (such a key may repeat)"
        )
    return None


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plus(v: Any, d: int) -> Any:
    return v + d if _num(v) else None


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return True  # cannot tell: count it as a match


def _name_fits(name: str, s: dict) -> bool:
    if "pattern" in s and not (isinstance(s["pattern"], str) and _search(s["pattern"], name)):
        return False
    if "const" in s and s["const"] != name:
        return False
    if isinstance(s.get("enum"), list) and name not in s["enum"]:
        return False
    if _num(s.get("minLength")) and len(name) < s["minLength"]:
        return False
    return not (_num(s.get("maxLength")) and len(name) > s["maxLength"])
