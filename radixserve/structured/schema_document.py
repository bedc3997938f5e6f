"""A JSON Schema document as its rewrite (``schema_rewrite``) sees it: where each node is,
where its local references point, and where each key of a rewritten node came from.

``SchemaDocument(root)`` indexes ``root`` once, leaving it as it is. A location (``Loc``) is
the tuple of keys and list indices from the root to a node; ``pointer(ref)`` resolves a local
``$ref`` (``#``, ``#/...``, JSON Pointer escapes) to one, or raises ``NotExact``, and
``movable(loc, keys)`` raises ``NotExact`` where a reference of the document points inside one
of ``keys`` of the node at ``loc`` (moving that part would leave it pointing elsewhere).
``frozen`` is set when nothing may be rewritten at all: ``unevaluatedProperties`` /
``unevaluatedItems`` anywhere (they depend on what sibling schemas evaluated), an ``$id`` or
anchor below the root (a reference there resolves elsewhere), a local ``$ref`` that does not
resolve.

``note(new, *sources)`` records, for a node the rewrite makes, the dotted path in the original
document of each of its keys (from the first source holding it) and keeps the node alive, so
its ``id`` stays its own; ``locate(node, key)`` answers from that record, or from the index
for a node of the original document, and None for any other node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from radixserve.structured.schema_merge import NotExact

_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "not",
        "unevaluatedProperties", "propertyNames", "contains", "if", "then", "else")  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
        "dependencies")  # fmt: skip
_FROZEN = ("unevaluatedProperties", "unevaluatedItems")
_ANCHORS = ("$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor")
Loc = tuple[str | int, ...]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and key else path or key


def _dotted(loc: Loc) -> str:
    out = ""
    for t in loc:
        out = f"{out}[{t}]" if isinstance(t, int) else _join(out, t)
    return out


def each_subschema(s: dict, loc: Loc, fn: Callable[[Any, Loc], Any]) -> dict:
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


class SchemaDocument:
    def __init__(self, root: Any):
        self.root = root
        self.paths: dict[int, str] = {}  # original node -> its dotted path
        self.origins: dict[int, dict[str, str | None]] = {}  # new node -> key -> path
        self.made: list[Any] = []  # the new nodes, kept alive so their ids stay theirs
        self.targets: list[Loc] = []  # where the document's $refs point
        self.frozen = False
        self._index(root, ())

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
                    self.targets.append(self.pointer(ref))
                except NotExact:
                    self.frozen = True  # cannot tell what it points at: nothing may move
            each_subschema(s, loc, self._index)
        return s

    def node_at(self, loc: Loc) -> Any:
        node: Any = self.root
        for t in loc:
            node = node[t]
        return node

    def pointer(self, ref: Any) -> Loc:
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

    def movable(self, loc: Loc, keys: list[str]) -> None:
        """NotExact where a ``$ref`` points inside one of ``keys`` of the node at ``loc``."""
        n = len(loc)
        if any(len(t) > n and t[:n] == loc and t[n] in keys for t in self.targets):
            raise NotExact("a reference points inside what would move")

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

    def note(self, new: dict, *sources: Any) -> dict:
        """Record where each key of the new node ``new`` came from (the first source with
        it), and keep ``new`` alive."""
        info: dict[str, str | None] = {"": self.locate(sources[0])}
        for k in new:
            src = next((s for s in sources if isinstance(s, dict) and k in s), sources[0])
            info[k] = self.locate(src, k)
        self.origins[id(new)] = info
        self.made.append(new)
        return new
