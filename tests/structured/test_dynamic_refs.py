"""``$recursiveRef`` / ``$dynamicRef`` in a one-resource document, enforced as the plain
``$ref`` they equal there: the grammar takes exactly the trees ``jsonschema`` accepts; where
the document holds another resource, it stays refused."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from radixserve.structured.grammar import check_grammar
from testing.grammar_walk import xgrammar_judge

NODE = {"type": "object", "required": ["name"], "additionalProperties": False}


def _node(draft: str, anchor: dict, ref: dict) -> dict:
    children = {"type": "array", "items": ref}
    return {"$schema": f"https://json-schema.org/draft/{draft}/schema", **anchor, **NODE,
            "properties": {"name": {"type": "string"}, "children": children}}  # fmt: skip


DYNAMIC = _node("2020-12", {"$dynamicAnchor": "node"}, {"$dynamicRef": "#node"})
RECURSIVE = _node("2019-09", {"$recursiveAnchor": True}, {"$recursiveRef": "#"})


def _tree(rng: random.Random, depth: int = 0):
    node: dict = {}
    if rng.random() < 0.9:
        node["name"] = rng.choice(["a", "b", 3])
    if depth < 2 and rng.random() < 0.6:
        node["children"] = [_tree(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.05:
        node["extra"] = 1
    return node if rng.random() < 0.97 else "leaf"


@pytest.mark.parametrize("schema", [DYNAMIC, RECURSIVE])
def test_a_dynamic_reference_takes_exactly_the_trees_the_schema_allows(schema):
    judge = xgrammar_judge(schema)
    validator = jsonschema.validators.validator_for(schema)(schema)
    rng, seen = random.Random(5), set()
    for _ in range(150):
        tree = _tree(rng)
        assert judge(tree) == validator.is_valid(tree), tree
        seen.add(validator.is_valid(tree))
    assert seen == {True, False}


def test_a_dynamic_reference_stays_refused_inside_another_resource():
    inner = {"$id": "https://example.com/inner", **DYNAMIC}
    nested = {"$schema": DYNAMIC["$schema"], "type": "object", "properties": {"t": inner}}
    with pytest.raises(ValueError, match="dynamic"):
        check_grammar("json_schema", json.dumps(nested))
