"""Which arrays of a JSON Schema must hold distinct items, and by which rule their items are
kept distinct while the output is written (``unique_tracker``).

A grammar cannot compare an item with the items before it, so ``uniqueItems: true`` is
enforced beside the grammar: the grammar engine compiles the schema without it
(``strip_unique``), and a tracker that reads the output bans the tokens that would complete
an item equal to an earlier one. Banning must never leave the grammar without a token to
write, so each array's items must be of a kind where a ban always leaves a way on
(``ItemRule``):

- ``free``: strings (with at most ``minLength``), numbers, any object, any array or any JSON
  value: until an item is complete it can always become another value (one more character,
  digit, key or element), so only the token completing an equal item is banned; a literal
  (``true``, ``false``, ``null``) is banned from its first letter once it was written;
- ``record``: an object whose properties are all such strings: the token closing a
  property's string is banned where the object so far equals an earlier item (the string
  could go on instead), and so is the ``}`` completing an equal one;
- ``listed``: a few listed values (strings of plain ASCII, integers, booleans, null), each
  written one way: a token is banned where the item so far is no longer the start of a value
  not yet used, and a ``,`` where every value is used.

Where one place of the output may be one of several schemas (``anyOf`` branches, ``$ref``s,
``allOf`` parts), the tracker cannot tell which the grammar follows, so an array is enforced
only where every schema it may meet there asks for distinct items of the same item schema;
other arrays with ``uniqueItems`` (tuples, items of another kind, a branch that does not ask
for it) are refused with ``UnsupportedSchema`` at their path.

``UniquePlan.of(doc)`` explores the places of the output as states (the set of schema objects
a value there must meet), ``value(place, kind)`` narrows a place to a kind of JSON value,
``member``/``item`` step into an object's key or an array's index, and ``rule`` says how an
array's items are kept distinct. State ``ANY`` is a place no schema constrains.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.structured.schema_forms import listed_values
from radixserve.structured.schema_merge import assertions
from radixserve.structured.schema_support import UnsupportedSchema
from radixserve.structured.schema_types import SchemaTypes, expand, type_of
from radixserve.structured.schema_walk import map_schemas, subschemas

ANY = 0  # the state of a place no schema object constrains
OTHER = object()  # a key no schema of the place names in its properties
MAX_STATES = 4096
KINDS = ("object", "array", "string", "number", "boolean", "null")
_APPLICATORS = {"$ref", "allOf", "anyOf", "oneOf"}
# keywords the engines refuse (or that cannot hold an array of the value), left out here
_IGNORED = {"not", "if", "then", "else", "dependencies", "dependentSchemas", "contains",
            "propertyNames", "unevaluatedProperties", "unevaluatedItems"}  # fmt: skip
_ARRAY_KEYS = {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"}
_PLAIN = re.compile(r"[ !#-\[\]-~]*")  # printable ASCII but '"' and '\': one JSON spelling
_UNCONSTRAINED: dict = {}  # stands for "any value" among a place's schemas


@dataclass(frozen=True)
class ItemRule:
    """How an array's items are kept distinct (see the module docstring)."""

    kind: str  # "free", "record" or "listed"
    strings_only: bool = False  # free: the items are strings only
    texts: tuple[bytes, ...] = ()  # listed: each value's JSON text


def asks_unique(s: dict) -> bool:
    """Whether ``s`` asks for distinct items (an array of at most one item always has them)."""
    short = isinstance(s.get("maxItems"), int | float) and s["maxItems"] <= 1
    return s.get("uniqueItems") is True and not short


def has_unique(doc: Any) -> bool:
    return any(asks_unique(s) for s, _ in subschemas(doc))


def strip_unique(doc: Any) -> Any:
    """The document without ``uniqueItems: true`` (the tracker enforces it instead)."""
    return map_schemas(doc, lambda s: {k: v for k, v in s.items()
                                       if not (k == "uniqueItems" and v is True)})  # fmt: skip


def _own_types(s: dict) -> frozenset[str]:
    out = expand(s["type"]) if "type" in s else frozenset(KINDS) | {"integer"}
    if "const" in s:
        out &= {type_of(s["const"])}
    if isinstance(s.get("enum"), list):
        out &= {type_of(v) for v in s["enum"]}
    return out


def _unconstrained(s: Any) -> bool:
    return s is True or (isinstance(s, dict) and not set(assertions(s)) - _IGNORED)


class UniquePlan:
    """The places of the output of one schema document, as far as ``uniqueItems`` needs."""

    def __init__(self, root: Any, where: Callable[[dict], str]):
        self.types, self._where = SchemaTypes(root), where
        # state -> its schema objects, each with whether it is only an allOf part; 0 is ANY
        self._nodes: list[tuple[tuple[Any, bool], ...]] = [()]
        self._ids: dict[tuple[str, frozenset[tuple[int, bool]]], int] = {}
        self._value: dict[tuple[int, str], int] = {}
        self._member: dict[tuple[int, Any], int] = {}
        self._item: dict[tuple[int, int], int] = {}
        self._tuple: dict[int, int] = {}  # array state -> how many indices it names
        self._rules: dict[int, ItemRule | None] = {}
        self.root = self._intern("p", self._place([root]))
        self._explore()

    @classmethod
    def of(cls, doc: Any, locate: Callable[[Any, str], str | None] | None = None
           ) -> UniquePlan | None:  # fmt: skip
        """The plan for ``doc``, None where it asks for no distinct items; ``locate(node,
        key)`` names a node's key in the schema as given (else its path in ``doc``)."""
        if not has_unique(doc):
            return None
        paths = {id(s): p for s, p in subschemas(doc)}

        def where(node: dict) -> str:
            found = locate(node, "uniqueItems") if locate else None
            base = paths.get(id(node), "")
            return found or (f"{base}.uniqueItems" if base else "uniqueItems")

        return cls(doc, where)

    # -- the states --------------------------------------------------------------------

    def _intern(self, tag: str, nodes: list[tuple[Any, bool]]) -> int:
        if all(n is _UNCONSTRAINED for n, _ in nodes):
            return ANY
        key = (tag, frozenset((id(n), part) for n, part in nodes))
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._nodes)
            self._nodes.append(tuple(nodes))
            if len(self._nodes) > MAX_STATES:
                raise UnsupportedSchema(self._first_unique(), "uniqueItems in a schema with too "
                                        "many places to follow is not supported")  # fmt: skip
        return found

    def _place(self, schemas: list) -> list[tuple[Any, bool]]:
        """The schema objects that apply to a value meeting all of ``schemas``: ``$ref``s
        followed, combinators opened (their branches, and whether each is only a part of an
        ``allOf``, which narrows the value, where an ``anyOf`` branch widens it)."""
        out: dict[int, tuple[Any, bool]] = {}
        seen: set[tuple[int, bool]] = set()
        for s in schemas:
            self._open(s, out, seen, part=False)
        return list(out.values())

    def _open(self, s: Any, out: dict, seen: set, part: bool) -> None:
        if s is False or (id(s), part) in seen:
            return
        seen.add((id(s), part))
        if _unconstrained(s):
            if not part:  # an allOf part without assertions changes nothing
                out[id(_UNCONSTRAINED)] = (_UNCONSTRAINED, False)
            return
        if not isinstance(s, dict):
            return
        if "$ref" in s:
            try:
                target = self.types.resolve(s["$ref"])
            except LookupError:
                target = True  # the engines refuse it themselves
            self._open(target, out, seen, part)
            if self.types.legacy:
                return  # drafts up to 7 ignore the keywords beside $ref
        if set(assertions(s)) - _APPLICATORS - _IGNORED:
            known = out.get(id(s))
            out[id(s)] = (s, part and (known is None or known[1]))
        for key in ("allOf", "anyOf", "oneOf"):
            for b in s[key] if isinstance(s.get(key), list) else []:
                self._open(b, out, seen, part=part or key == "allOf")

    def value(self, place: int, kind: str) -> int:
        """The state of a value of ``kind`` (one of ``KINDS``) at ``place``."""
        if place == ANY:
            return ANY
        key = (place, kind)
        found = self._value.get(key)
        if found is None:
            kinds = {kind, "integer"} if kind == "number" else {kind}
            nodes = [(n, part) for n, part in self._nodes[place]
                     if n is _UNCONSTRAINED or _own_types(n) & kinds]  # fmt: skip
            found = self._value[key] = self._intern("v", nodes)
        return found

    def member(self, state: int, key: Any) -> int:
        """The place of the value of ``key`` (a string, or ``OTHER``) in an object."""
        if state == ANY:
            return ANY
        if key is not OTHER and key not in self._named(state):
            key = OTHER
        found = self._member.get((state, key))
        if found is None:
            schemas: list = []
            for n, _ in self._nodes[state]:
                schemas += _member_schemas(n, key)
            found = self._member[(state, key)] = self._intern("p", self._place(schemas))
        return found

    def item(self, state: int, index: int) -> int:
        """The place of the item at ``index`` in an array."""
        if state == ANY:
            return ANY
        index = min(index, self._tuple_length(state))
        found = self._item.get((state, index))
        if found is None:
            schemas = [_item_schema(n, index) for n, _ in self._nodes[state]]
            found = self._item[(state, index)] = self._intern("p", self._place(schemas))
        return found

    def rule(self, state: int) -> ItemRule | None:
        """How the items of an array in ``state`` are kept distinct, or None (not asked)."""
        return self._rules.get(state) if state != ANY else None

    # -- exploring every place, and the rule of each array -------------------------------

    def _named(self, state: int) -> set[str]:
        names: set[str] = set()
        for n, _ in self._nodes[state]:
            props = n.get("properties")
            names |= set(props) if isinstance(props, dict) else set()
        return names

    def _tuple_length(self, state: int) -> int:
        found = self._tuple.get(state)
        if found is None:
            lengths = [len(n.get("prefixItems") or n.get("items") or [])
                       if isinstance(n.get("prefixItems", n.get("items")), list) else 0
                       for n, _ in self._nodes[state]]  # fmt: skip
            found = self._tuple[state] = max(lengths, default=0)
        return found

    def _explore(self) -> None:
        todo, seen = [self.root], {ANY}
        while todo:
            place = todo.pop()
            if place in seen:
                continue
            seen.add(place)
            obj, arr = self.value(place, "object"), self.value(place, "array")
            nexts = [self.member(obj, k) for k in [*sorted(self._named(obj)), OTHER]]
            rule = self._rules[arr] = self._array_rule(arr)
            if rule is None:  # the items of an enforced array hold no array that asks
                nexts += [self.item(arr, i) for i in range(self._tuple_length(arr) + 1)]
            todo += [p for p in nexts if p not in seen]

    def _array_rule(self, state: int) -> ItemRule | None:
        nodes = self._nodes[state]
        unique = [n for n, _ in nodes if n is not _UNCONSTRAINED and asks_unique(n)]
        if not unique:
            return None
        where = self._where(unique[0])
        for n, part in nodes:
            if n is _UNCONSTRAINED or n.get("uniqueItems") is True:
                widens = n is _UNCONSTRAINED
            else:  # an anyOf branch allows other arrays; an allOf part may narrow the items
                widens = not part or bool(set(n) & {"items", "prefixItems", "additionalItems"})
            if widens:
                raise UnsupportedSchema(where, "uniqueItems where the array may also meet a "
                                        "schema that does not ask for it is not "
                                        "supported")  # fmt: skip
        items = {json.dumps(n.get("items", True), sort_keys=True) for n in unique}
        if len(items) > 1 or any(isinstance(n.get("items"), list) or "prefixItems" in n
                                 for n in unique):  # fmt: skip
            raise UnsupportedSchema(where, "uniqueItems over a tuple or over items of several "
                                    "schemas is not supported")  # fmt: skip
        rule = self._item_rule(unique[0].get("items", True), 0)
        if rule is None:
            raise UnsupportedSchema(where, "uniqueItems is not supported on these items (only "
                                    "on free strings, numbers, objects or values, records of "
                                    "free strings, or a few listed values)")  # fmt: skip
        for n in unique:
            low = n.get("minItems", 0)
            if rule.kind == "listed" and isinstance(low, int) and low > len(rule.texts):
                raise UnsupportedSchema(where, "uniqueItems with minItems above the number of "
                                        "values the items may take is not supported")  # fmt: skip
        return rule

    def _item_rule(self, s: Any, depth: int) -> ItemRule | None:
        if depth > 16:
            return None
        if isinstance(s, dict) and "$ref" in s:
            if set(assertions(s)) - {"$ref"} and not self.types.legacy:
                return None
            try:
                return self._item_rule(self.types.resolve(s["$ref"]), depth + 1)
            except LookupError:
                return None
        if _unconstrained(s):
            return ItemRule("free")
        if not isinstance(s, dict):
            return None
        keys = set(assertions(s))
        branches = s.get("anyOf", s.get("oneOf"))
        if isinstance(branches, list) and keys in ({"anyOf"}, {"oneOf"}) and branches:
            return _union([self._item_rule(b, depth + 1) for b in branches])
        values = listed_values(s)
        if values is not None:
            return _listed(values)
        return _free(s) or self._record(s, depth)

    def _record(self, s: dict, depth: int) -> ItemRule | None:
        keys = set(assertions(s))
        props, extra = s.get("properties"), s.get("additionalProperties")
        if keys - {"type", "properties", "required", "additionalProperties"} or not props:
            return None
        if "type" in s and expand(s["type"]) != {"object"} or not isinstance(props, dict):
            return None
        rules = [self._item_rule(v, depth + 1) for v in props.values()]
        if extra not in (None, False):
            rules.append(self._item_rule(extra, depth + 1))
        if all(r is not None and r.strings_only for r in rules):
            return ItemRule("record")
        return None

    def _first_unique(self) -> str:
        found = next((s for s, _ in subschemas(self.types.root)
                      if asks_unique(s)), None)  # fmt: skip
        return self._where(found) if found is not None else "uniqueItems"


def _member_schemas(n: Any, key: Any) -> list:
    if n is _UNCONSTRAINED:
        return [True]
    props = n.get("properties") if isinstance(n.get("properties"), dict) else {}
    patterns = n.get("patternProperties") if isinstance(n.get("patternProperties"), dict) else {}
    extra = n.get("additionalProperties", True)
    if key is OTHER:
        return [*patterns.values(), extra]
    matched = [v for p, v in patterns.items() if _search(p, key)]
    if key in props:
        return [props[key], *matched]
    return matched or [extra]


def _item_schema(n: Any, index: int) -> Any:
    if n is _UNCONSTRAINED:
        return True
    if isinstance(n.get("prefixItems"), list):
        fixed, rest = n["prefixItems"], n.get("items", True)
    elif isinstance(n.get("items"), list):
        fixed, rest = n["items"], n.get("additionalItems", True)
    else:
        fixed, rest = [], n.get("items", True)
    return fixed[index] if index < len(fixed) else rest


def _search(pattern: str, key: str) -> bool:
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return True  # cannot tell: counted as a match (more schemas, never fewer)


def _free(s: dict) -> ItemRule | None:
    """A free kind: strings with at most minLength, numbers, any object, any array."""
    keys = set(assertions(s))
    kinds = s.get("type")
    names = kinds if isinstance(kinds, list) else [kinds]
    if "type" not in keys or not keys <= {"type", "minLength"}:
        return None
    if not names or not set(names) <= {"string", "number", "object", "array"}:
        return None
    return ItemRule("free", strings_only=set(names) == {"string"})


def _listed(values: list) -> ItemRule | None:
    ok = all(v is None or isinstance(v, (bool, int)) or isinstance(v, str) and _PLAIN.fullmatch(v)
             for v in values)  # fmt: skip
    if not ok or not values:
        return None
    return ItemRule("listed", texts=tuple(json.dumps(v).encode() for v in values))


def _union(rules: list[ItemRule | None]) -> ItemRule | None:
    if any(r is None for r in rules):
        return None
    kinds = {r.kind for r in rules if r is not None}
    if kinds == {"free"}:
        return ItemRule("free", strings_only=all(r.strings_only for r in rules if r))
    if kinds == {"listed"}:
        texts = dict.fromkeys(t for r in rules if r for t in r.texts)
        return ItemRule("listed", texts=tuple(texts))
    return None
