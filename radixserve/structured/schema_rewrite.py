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
restructured where a ``$ref`` points inside what would move (``schema_document`` tells both).
``SchemaRewrite(schema).locate(node, key)`` names, for a node of the rewritten schema, the
dotted path in the original where ``key`` came from, so a refusal points at what the user
wrote.
"""

from __future__ import annotations

from functools import reduce
from typing import Any

from radixserve.structured.schema_conditions import discriminated
from radixserve.structured.schema_document import Loc, SchemaDocument, each_subschema
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


def rewrite_schema(schema: Any) -> Any:
    """``schema`` rewritten where that is exact (see the module docstring)."""
    return SchemaRewrite(schema).result


def _trivial(s: Any) -> bool:
    return s is True or (isinstance(s, dict) and not assertions(s))


class SchemaRewrite:
    """The rewrite of one schema document (``result``; the document itself when not
    ``enabled``), and where its parts came from."""

    def __init__(self, root: Any, enabled: bool = True):
        root = static_refs(root) if enabled else root
        self.doc, self.types = SchemaDocument(root), SchemaTypes(root)
        self.done: dict[Loc, Any] = {}
        self.busy: set[Loc] = set()
        self.merging: set[Loc] = set()  # the $refs whose targets are being merged
        self.budget = MERGE_BUDGET
        self.result = root if self.doc.frozen or not enabled else self.visit(root, ())

    def locate(self, node: Any, key: str = "") -> str | None:
        """The original dotted path of ``key`` in ``node`` (of ``node`` itself without a
        key), or None where the node is not from the document's schema tree."""
        return self.doc.locate(node, key)

    def visit(self, s: Any, loc: Loc) -> Any:
        """The rewrite of the original node ``s`` at ``loc`` (once per location)."""
        if not isinstance(s, dict):
            return s
        if loc in self.done:
            return self.done[loc]
        self.busy.add(loc)
        copy = self.doc.note(each_subschema(s, loc, self.visit), s)
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
            self.doc.movable(loc, keys)
            out = self._flat(s)
            if out is False:
                raise NotExact("no value meets it")
            s = self._attach(out, s)
        one_of = s.get("oneOf") if isinstance(s, dict) else None
        if isinstance(one_of, list) and len(assertions(s)) == 1:
            kept = one_of_closed(one_of)
            if kept:
                self.doc.movable(loc, ["oneOf"])
                branches = [self.doc.note(new, old) for old, new in kept]
                s = self._attach(self.doc.note({"anyOf": branches}, s), s)
        return self._unique(s, loc)

    def _not(self, s: dict, loc: Loc) -> dict:
        """Patterns without an opening lookahead, ``not`` of listed values on a string as a
        pattern, ``not`` of ``required`` as an ``allOf`` part that closes keys out,
        dependencies as parts that close a key out or require what it brings, conditions
        on a discriminator as the ``anyOf`` of its cases."""
        plain = lookahead_free(s)
        if plain is not None:
            if plain.get("patternProperties") is not s.get("patternProperties"):
                self.doc.movable(loc, ["patternProperties"])
            s = self.doc.note(plain, s)
        if isinstance(s.get("not"), dict):
            try:
                kept = not_listed_strings(s, self._flat(s["not"]))
            except NotExact:
                kept = None
            if kept is not None:
                self.doc.movable(loc, ["not"])
                s = self.doc.note(kept, s)
        alt = absent_keys(s.get("not"))
        if alt is not None and isinstance(s.get("allOf", []), list):
            self.doc.movable(loc, ["not"])
            rest = {k: v for k, v in s.items() if k != "not"}
            s = self.doc.note(
                {**rest, "allOf": [*s.get("allOf", []), self.doc.note(alt, s["not"])]}, s
            )
        parts = dependency_parts(s)
        if parts is not None and isinstance(s.get("allOf", []), list):
            self.doc.movable(loc, list(DEPENDENCIES))
            rest = {k: v for k, v in s.items() if k not in DEPENDENCIES}
            s = self.doc.note({**rest, "allOf": [*s.get("allOf", []), *parts]}, s)
        cases = discriminated(s)
        if cases is not None:
            self.doc.movable(loc, ["allOf", "if", "then", "else"])
            s = self.doc.note(cases, s)
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
        refs = {self.doc.pointer(s["$ref"]) for s in (x, y) if "$ref" in s}
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
            return self.doc.note({comb: branches}, node) if branches else False
        out = merge_flat(x, y, self.merge)
        return out if out is False else self.doc.note(out, x, y)

    def _expand(self, ref: Any) -> Any:
        """The target of a local ``$ref``, rewritten and flat (not back into itself)."""
        loc = self.doc.pointer(ref)
        if loc in self.busy:
            raise NotExact("a reference back into itself")
        target = self.visit(self.doc.node_at(loc), loc)
        self.busy.add(loc)
        try:
            return self._flat(target)
        finally:
            self.busy.discard(loc)

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
        self.doc.movable(loc, ["items"])
        return self._attach(self.doc.note({"enum": arrays}, s), s)

    def _part(self, s: dict, keys: list[str]) -> dict:
        return self.doc.note({k: s[k] for k in keys}, s)

    def _attach(self, out: Any, s: dict) -> Any:
        """``out`` with the annotations of ``s`` (its ``$defs``, title, ...) beside it."""
        if not isinstance(out, dict) and out is not True:
            return out
        kept = {k: v for k, v in out.items() if k in ASSERTIONS} if out is not True else {}
        return self.doc.note({**kept, **{k: v for k, v in s.items() if k not in ASSERTIONS}},
                          out, s)  # fmt: skip
