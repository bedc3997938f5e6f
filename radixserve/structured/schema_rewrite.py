"""A JSON Schema rewritten into an equivalent one that the grammar engine compiles exactly.

``rewrite_schema(schema)`` returns a schema that accepts exactly the values ``schema``
accepts (a pure function; its input is left as it is). The grammar compiler (``grammar.py``)
compiles the rewritten schema and the support check (``schema_support``) walks it, so the
check judges what is compiled: a rewrite can turn a refusal into an exact schema, never let
a wrong one through. Each rewrite is made only where it is exact (``schema_merge``); where it
is not, that part stays as it was, and the check refuses it as before:

- ``allOf``: its schemas and the keywords beside it merged into one schema;
- ``$ref`` with keywords beside it (drafts 2019-09 on, where both apply): the target inlined
  (a local reference, not back into itself) and merged with them;
- keywords beside ``anyOf`` or ``oneOf`` (another combinator among them, if the product
  has at most ``COMBINED_LIMIT`` branches): merged into each branch (``anyOf(b1..bn)`` and
  ``K`` is ``anyOf(b1 and K, ..., bn and K)``, and so for ``oneOf``), dropping a branch no
  value then meets;
- ``$recursiveRef`` / ``$dynamicRef`` in a document that is one resource: the plain
  ``$ref`` they equal there (``schema_dynamic``);
- patterns opening with a lookahead of literal words, ``not`` of listed strings: exact
  patterns (``schema_patterns``); ``if``/``then``/``else`` decided by one key's value: the
  ``anyOf`` of its cases (``schema_conditions``);
- a ``oneOf`` of closed objects that differ only in what they require, ``uniqueItems``
  over a few listed values, and ``not`` of ``required``: the exclusive ``anyOf``, the
  ``enum`` and the closed-out keys of ``schema_forms``.

Nothing is rewritten in a schema with ``unevaluatedProperties``/``unevaluatedItems`` (they
depend on what sibling schemas evaluated), an ``$id``/``$anchor`` below its root (a reference
there resolves elsewhere) or a local ``$ref`` it cannot resolve, and a node is not
restructured where a ``$ref`` points inside what would move.
``SchemaRewrite(schema).locate(node, key)`` names, for a node of the rewritten schema, the
dotted path in the original where ``key`` came from, so a refusal points at what the user
wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from typing import Any
from urllib.parse import unquote

from radixserve.structured.schema_conditions import discriminated
from radixserve.structured.schema_dynamic import static_refs
from radixserve.structured.schema_forms import (
    DEPENDENCIES,
    absent_keys,
    dependency_parts,
    one_of_closed,
    unique_arrays,
)
from radixserve.structured.schema_merge import NotExact, assertions, merge_flat
from radixserve.structured.schema_patterns import lookahead_free, not_listed_strings
from radixserve.structured.schema_types import ASSERTIONS, SchemaTypes

COMBINED_LIMIT = 16  # branches of a combinator merged with another
MERGE_BUDGET = 1_000  # merges per document (real schemas need a dozen), then no more
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "not",
        "unevaluatedProperties", "propertyNames", "contains", "if", "then", "else")  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
        "dependencies")  # fmt: skip
_FROZEN = ("unevaluatedProperties", "unevaluatedItems")
_ANCHORS = ("$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor")
Loc = tuple[str | int, ...]


def rewrite_schema(schema: Any) -> Any:
    """``schema`` rewritten where that is exact (see the module docstring)."""
    return SchemaRewrite(schema).result


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and key else path or key


def _dotted(loc: Loc) -> str:
    out = ""
    for t in loc:
        out = f"{out}[{t}]" if isinstance(t, int) else _join(out, t)
    return out


def _trivial(s: Any) -> bool:
    return s is True or (isinstance(s, dict) and not assertions(s))


def _each(s: dict, loc: Loc, fn: Callable[[Any, Loc], Any]) -> dict:
    """``s`` with ``fn(child, its location)`` in place of each sub-schema."""
    out = dict(s)
    for k, v in s.items():
        if k in _ONE and isinstance(v, dict):
            out[k] = fn(v, (*loc, k))
        elif k in _LIST and isinstance(v, list):
            out[k] = [fn(x, (*loc, k, i)) for i, x in enumerate(v)]
        elif k in _MAP and isinstance(v, dict):
            out[k] = {n: fn(x, (*loc, k, n)) for n, x in v.items()}
    return out


class SchemaRewrite:
    """The rewrite of one schema document (``result``; the document itself when not
    ``enabled``), and where its parts came from."""

    def __init__(self, root: Any, enabled: bool = True):
        root = static_refs(root) if enabled else root
        self.root, self.types = root, SchemaTypes(root)
        self.paths: dict[int, str] = {}  # original node -> its dotted path
        self.origins: dict[int, dict[str, str | None]] = {}  # new node -> key -> path
        self.made: list[Any] = []  # the new nodes, kept alive so their ids stay theirs
        self.done: dict[Loc, Any] = {}
        self.busy: set[Loc] = set()
        self.targets: list[Loc] = []  # where the document's $refs point
        self.merging: set[Loc] = set()  # the $refs whose targets are being merged
        self.budget = MERGE_BUDGET
        self.frozen = False
        self._index(root, ())
        self.result = root if self.frozen or not enabled else self.visit(root, ())

    def locate(self, node: Any, key: str = "") -> str | None:
        """The original dotted path of ``key`` in ``node`` (of ``node`` itself without a
        key), or None where the node is not from the document's schema tree."""
        info = self.origins.get(id(node))
        if info is not None:
            if key in info:
                return info[key]
            return None if info[""] is None else _join(info[""], key)
        path = self.paths.get(id(node))
        return None if path is None else _join(path, key)

    def _index(self, s: Any, loc: Loc) -> Any:
        if isinstance(s, dict):
            self.paths[id(s)] = _dotted(loc)
            if any(k in s for k in _FROZEN) or (
                loc and any(isinstance(s.get(k), str) for k in _ANCHORS)
            ):
                self.frozen = True
            ref = s.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                try:
                    self.targets.append(self._pointer(ref))
                except NotExact:
                    self.frozen = True  # cannot tell what it points at: nothing may move
            _each(s, loc, self._index)
        return s

    def visit(self, s: Any, loc: Loc) -> Any:
        """The rewrite of the original node ``s`` at ``loc`` (once per location)."""
        if not isinstance(s, dict):
            return s
        if loc in self.done:
            return self.done[loc]
        self.busy.add(loc)
        copy = self._note(_each(s, loc, self.visit), s)
        try:
            out = self._normal(copy, loc)
        except NotExact:
            out = copy
        self.busy.discard(loc)
        self.done[loc] = out
        return out

    def _normal(self, s: dict, loc: Loc) -> Any:
        s = self._not(s, loc)
        keys = list(assertions(s))
        combs = [k for k in ("anyOf", "oneOf") if k in s]
        if "$ref" in s:  # drafts up to 7 ignore the keywords beside it: nothing to merge
            needed = len(keys) > 1 and not self.types.legacy
        else:
            all_of = s.get("allOf")
            needed = (isinstance(all_of, list) and (len(all_of) > 1 or len(keys) > 1)) or (
                len(combs) == 1 and len(keys) > 1
            )
        if needed:
            self._movable(loc, keys)
            out = self._flat(s)
            if out is False:
                raise NotExact("no value meets it")
            s = self._attach(out, s)
        one_of = s.get("oneOf") if isinstance(s, dict) else None
        if isinstance(one_of, list) and len(assertions(s)) == 1:
            kept = one_of_closed(one_of)
            if kept:
                self._movable(loc, ["oneOf"])
                branches = [self._note(new, old) for old, new in kept]
                s = self._attach(self._note({"anyOf": branches}, s), s)
        return self._unique(s, loc)

    def _not(self, s: dict, loc: Loc) -> dict:
        """Patterns without an opening lookahead, ``not`` of listed values on a string as a
        pattern, ``not`` of ``required`` as an ``allOf`` part that closes keys out,
        dependencies as parts that close a key out or require what it brings, conditions
        on a discriminator as the ``anyOf`` of its cases."""
        plain = lookahead_free(s)
        if plain is not None:
            if plain.get("patternProperties") is not s.get("patternProperties"):
                self._movable(loc, ["patternProperties"])
            s = self._note(plain, s)
        if isinstance(s.get("not"), dict):
            try:
                kept = not_listed_strings(s, self._flat(s["not"]))
            except NotExact:
                kept = None
            if kept is not None:
                self._movable(loc, ["not"])
                s = self._note(kept, s)
        alt = absent_keys(s.get("not"))
        if alt is not None and isinstance(s.get("allOf", []), list):
            self._movable(loc, ["not"])
            rest = {k: v for k, v in s.items() if k != "not"}
            s = self._note({**rest, "allOf": [*s.get("allOf", []), self._note(alt, s["not"])]}, s)
        parts = dependency_parts(s)
        if parts is not None and isinstance(s.get("allOf", []), list):
            self._movable(loc, list(DEPENDENCIES))
            rest = {k: v for k, v in s.items() if k not in DEPENDENCIES}
            s = self._note({**rest, "allOf": [*s.get("allOf", []), *parts]}, s)
        cases = discriminated(s)
        if cases is not None:
            self._movable(loc, ["allOf", "if", "then", "else"])
            s = self._note(cases, s)
        return s

    def _flat(self, s: Any) -> Any:
        """``s`` as one schema without ``allOf`` or ``$ref``, and with nothing beside an
        ``anyOf``/``oneOf`` (False: no value meets it)."""
        if not isinstance(s, dict):
            return s
        keys = list(assertions(s))
        if "$ref" in s and self.types.legacy:  # drafts up to 7 ignore the keywords beside it
            return self._expand(s["$ref"])
        if "allOf" in s:
            if not isinstance(s["allOf"], list):
                raise NotExact("allOf that is not a list")
            rest = self._part(s, [k for k in keys if k != "allOf"])
            return reduce(self.merge, [*s["allOf"], rest])
        if "$ref" in s:
            rest = self._part(s, [k for k in keys if k != "$ref"])
            return self.merge(self._expand(s["$ref"]), rest)
        combs = [k for k in ("anyOf", "oneOf") if k in s]
        if len(combs) > 1:
            raise NotExact("anyOf beside oneOf")
        if combs and len(keys) > 1:
            rest = self._part(s, [k for k in keys if k != combs[0]])
            return self.merge(rest, self._part(s, combs))
        return s

    def merge(self, x: Any, y: Any) -> Any:
        """One schema for ``x`` and ``y`` both (False: no value meets both)."""
        if x is False or y is False:
            return False
        if _trivial(x) or _trivial(y):
            return y if _trivial(x) else x
        if not (isinstance(x, dict) and isinstance(y, dict)):
            raise NotExact("a schema that is not an object")
        self.budget -= 1
        if self.budget < 0:
            raise NotExact("too much to merge")
        refs = {self._pointer(s["$ref"]) for s in (x, y) if "$ref" in s}
        if refs & self.merging:
            raise NotExact("a reference back into itself")
        self.merging |= refs
        try:
            return self._merge(x, y)
        finally:
            self.merging -= refs

    def _merge(self, x: dict, y: dict) -> Any:
        x, y = self._flat(x), self._flat(y)
        if x is False or y is False or _trivial(x) or _trivial(y):
            return self.merge(x, y)
        cx, cy = (next((k for k in ("anyOf", "oneOf") if k in s), None) for s in (x, y))
        if cx and cy:  # comb(a1..an) and K is comb(a1 and K, ...), K a combinator too
            if not (isinstance(x[cx], list) and isinstance(y[cy], list)):
                raise NotExact("a combinator that is not a list")
            if len(x[cx]) * len(y[cy]) > COMBINED_LIMIT:
                raise NotExact("a combinator in both schemas, with too many branches")
            cy = None
        if cx or cy:
            flat, node, comb = (y, x, cx) if cx else (x, y, cy)
            if not isinstance(node[comb], list):
                raise NotExact(f"{comb} that is not a list")
            branches = [m for m in (self.merge(flat, b) for b in node[comb]) if m is not False]
            return self._note({comb: branches}, node) if branches else False
        out = merge_flat(x, y, self.merge)
        return out if out is False else self._note(out, x, y)

    def _expand(self, ref: Any) -> Any:
        """The target of a local ``$ref``, rewritten and flat (not back into itself)."""
        loc = self._pointer(ref)
        if loc in self.busy:
            raise NotExact("a reference back into itself")
        node: Any = self.root
        for t in loc:
            node = node[t]
        target = self.visit(node, loc)
        self.busy.add(loc)
        try:
            return self._flat(target)
        finally:
            self.busy.discard(loc)

    def _pointer(self, ref: Any) -> Loc:
        """The location a local ``$ref`` points at (list indices as ints)."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise NotExact(f"{ref!r} is not a local reference")
        loc: list[str | int] = []
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                loc.append(int(part))
            elif isinstance(node, dict) and part in node:
                loc.append(part)
            else:
                raise NotExact(f"cannot resolve {ref!r}")
            node = node[loc[-1]]
        return tuple(loc)

    def _movable(self, loc: Loc, keys: list[str]) -> None:
        """NotExact where a ``$ref`` points inside one of ``keys`` of the node at ``loc``."""
        n = len(loc)
        if any(len(t) > n and t[:n] == loc and t[n] in keys for t in self.targets):
            raise NotExact("a reference points inside what would move")

    def _unique(self, s: Any, loc: Loc) -> Any:
        """An array of distinct items from a few listed values, as the enum of them all."""
        if not (isinstance(s, dict) and s.get("uniqueItems") is True):
            return s
        try:
            items = self._flat(s["items"]) if isinstance(s.get("items"), dict) else None
        except NotExact:
            return s
        arrays = unique_arrays(s, items)
        if arrays is None:
            return s
        self._movable(loc, ["items"])
        return self._attach(self._note({"enum": arrays}, s), s)

    def _part(self, s: dict, keys: list[str]) -> dict:
        return self._note({k: s[k] for k in keys}, s)

    def _attach(self, out: Any, s: dict) -> Any:
        """``out`` with the annotations of ``s`` (its ``$defs``, title, ...) beside it."""
        if not isinstance(out, dict) and out is not True:
            return out
        kept = {k: v for k, v in out.items() if k in ASSERTIONS} if out is not True else {}
        return self._note({**kept, **{k: v for k, v in s.items() if k not in ASSERTIONS}},
                          out, s)  # fmt: skip

    def _note(self, new: dict, *sources: Any) -> dict:
        """Record where each key of the new node ``new`` came from (the first source with
        it), and keep ``new`` alive."""
        info: dict[str, str | None] = {"": self.locate(sources[0])}
        for k in new:
            src = next((s for s in sources if isinstance(s, dict) and k in s), sources[0])
            info[k] = self.locate(src, k)
        self.origins[id(new)] = info
        self.made.append(new)
        return new
