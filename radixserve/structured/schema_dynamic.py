"""Dynamic references of a one-resource schema document, as the plain ``$ref`` they equal.

``$recursiveRef`` (draft 2019-09) and ``$dynamicRef`` (draft 2020-12) resolve first like a
``$ref``, then, where that target carries a ``$recursiveAnchor: true`` / a ``$dynamicAnchor``
of the same name, to the outermost schema *resource* in the dynamic scope with the same
anchor. A document without an ``$id`` below its root is a single resource, so the dynamic
scope holds no other one and each reference lands where it first resolved: ``$recursiveRef:
"#"`` is ``$ref: "#"``, and ``$dynamicRef: "#name"`` is a ``$ref`` to the JSON pointer of the
one schema object with ``$dynamicAnchor: name``.

``static_refs(schema)`` returns the document with each such reference so replaced and the
anchors no reference reads any more left out, or the document itself where the form does not
apply (another draft, where these keywords mean nothing; an ``$id`` below the root; an
anchor missing or named twice; a reference beside a ``$ref``): the check then refuses the
keyword as before.
"""

from __future__ import annotations

from typing import Any

from radixserve.structured.schema_walk import MANY, NAMED, ONE, map_schemas

_KEYS = {"2019-09": ("$recursiveRef", "$recursiveAnchor"),
         "2020-12": ("$dynamicRef", "$dynamicAnchor")}  # fmt: skip


def _draft(schema: dict) -> str | None:
    uri = schema.get("$schema")
    if uri is None:
        return "2020-12"  # the latest draft, as a schema without $schema is read
    return next((d for d in _KEYS if isinstance(uri, str) and f"/draft/{d}/" in uri), None)


def _located(s: Any, pointer: str = "#"):
    """Every schema object of the document with its JSON pointer."""
    if not isinstance(s, dict):
        return
    yield s, pointer
    for key, value in s.items():
        at = f"{pointer}/{key.replace('~', '~0').replace('/', '~1')}"
        if key in MANY and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _located(sub, f"{at}/{i}")
        elif key in ONE and isinstance(value, dict):
            yield from _located(value, at)
        elif key in NAMED and isinstance(value, dict):
            for name, sub in value.items():
                yield from _located(sub, f"{at}/{name.replace('~', '~0').replace('/', '~1')}")


def static_refs(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    draft = _draft(schema)
    if draft is None:
        return schema
    ref_key, anchor_key = _KEYS[draft]
    nodes = list(_located(schema))
    if not any(ref_key in n for n, _ in nodes):
        return schema
    if any(isinstance(n.get("$id"), str) and p != "#" for n, p in nodes):
        return schema  # another resource inside: its own dynamic scope
    targets: dict[str, str] = {}
    for node, pointer in nodes:
        name = node.get(anchor_key)
        if draft == "2020-12" and isinstance(name, str):
            if name in targets:
                return schema
            targets[name] = pointer
    resolved = _resolver(draft, targets)
    if any(ref_key in n and ("$ref" in n or resolved(n[ref_key]) is None) for n, _ in nodes):
        return schema

    def replace(s: dict) -> dict:
        out = {k: v for k, v in s.items() if k not in (ref_key, anchor_key)}
        if ref_key in s:
            out["$ref"] = resolved(s[ref_key])
        return out

    return map_schemas(schema, replace)


def _resolver(draft: str, targets: dict[str, str]):
    def resolved(ref: Any) -> str | None:
        if draft == "2019-09":
            return "#" if ref == "#" else None
        if isinstance(ref, str) and ref.startswith("#") and not ref.startswith("#/"):
            return targets.get(ref[1:])
        return ref if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) else None

    return resolved
