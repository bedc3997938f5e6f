"""The schema rewrite: each rewritten schema accepts exactly what the original accepts
(``jsonschema`` on hand-written valid and invalid instances, on random JSON values, and on
texts sampled from the grammar compiled from the rewritten schema, which must all validate),
the construct is no longer refused, and what cannot be rewritten exactly is still refused,
named by its path in the schema as given."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.structured.schema_forms import UNIQUE_LIMIT
from radixserve.structured.schema_rewrite import rewrite_schema
from radixserve.structured.schema_support import UnsupportedSchema, check_schema_support
from radixserve.structured.xgrammar_backend import XGrammarBackend

xgrammar_check = XGrammarBackend().prepare  # what xgrammar compiles, or its refusal


def exact_schema_text(text: str) -> str:
    return xgrammar_check("json_schema", text)


INT = {"type": "integer"}
STR = {"type": "string"}
DEFS_AB = {  # two object shapes told apart by "kind"
    "a": {"properties": {"kind": {"const": "a"}, "x": INT}, "required": ["kind"]},
    "b": {"properties": {"kind": {"const": "b"}, "y": STR}, "required": ["kind"]},
}

# (schema, instances it accepts, instances it refuses)
REWRITTEN = [
    ({"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                {"properties": {"b": STR}, "required": ["b"]}]},
     [{"a": 1, "b": "x"}], [{"a": 1}, {"b": "x"}, {"a": "1", "b": "x"}, 5]),
    ({"$defs": {"base": {"type": "object", "properties": {"name": STR}, "required": ["name"]}},
      "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"n": INT}}]},
     [{"name": "x"}, {"name": "x", "n": 2}], [{"n": 2}, {"name": "x", "n": "2"}, []]),
    ({"allOf": [{"type": "object", "properties": {"a": INT}, "additionalProperties": False},
                {"properties": {"a": {"minimum": 0}, "b": STR}}]},
     [{}, {"a": 1}], [{"a": -1}, {"a": 1, "b": "x"}, {"c": 1}]),
    ({"allOf": [{"type": "integer", "minimum": 0, "maximum": 10, "multipleOf": 2},
                {"minimum": 3, "maximum": 20, "multipleOf": 3}]},
     [6], [0, 3, 12, 9, "6"]),
    ({"allOf": [{"type": ["string", "integer"]}, {"type": ["number", "null"]}]},
     [3, -7], [3.5, "x", None]),
    ({"allOf": [{"enum": ["a", "b", 1]}, {"type": "string"}, {"enum": ["b", "a", "c"]}]},
     ["a", "b"], [1, "c"]),
    ({"$defs": {"s": {"type": "string", "maxLength": 5}}, "$ref": "#/$defs/s", "minLength": 2},
     ["ab", "abcde"], ["a", "abcdef", 5]),
    ({"type": "string", "anyOf": [{"enum": ["red", "blue"]}, {"pattern": "^#[0-9a-f]{6}$"}]},
     ["red", "#00ff00"], ["green", "#00ff0", 3]),
    ({"$defs": DEFS_AB, "type": "object", "properties": {"name": STR}, "required": ["name"],
      "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]},
     [{"name": "n", "kind": "a", "x": 1}, {"name": "n", "kind": "b"}],
     [{"kind": "a"}, {"name": "n", "kind": "c"}, {"name": "n", "kind": "b", "y": 1}]),
    ({"type": "object", "properties": {"src": STR, "handle": STR},
      "anyOf": [{"required": ["src"]}, {"required": ["handle"]}]},
     [{"src": "a"}, {"handle": "b"}, {"src": "a", "handle": "b"}], [{}, {"src": 1}, "x"]),
    ({"type": "string", "oneOf": [INT, {"type": "string", "maxLength": 3}]},
     ["abc"], ["abcd", 3]),
    ({"type": "object", "properties": {"a": INT, "b": INT},
      "allOf": [{"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}]},
     [{"a": 1}, {"b": 2}], [{}, {"a": "1"}]),
    ({"type": "array", "items": {"enum": ["de", "int"]}, "uniqueItems": True},
     [[], ["de"], ["int", "de"]], [["de", "de"], ["x"], "de"]),
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 1},
     [[True], [False, True]], [[], [True, True], [1]]),
    ({"$defs": {"m": {"type": "string", "enum": ["GET", "PUT", "POST"]}}, "type": "array",
      "items": {"$ref": "#/$defs/m"}, "uniqueItems": True, "maxItems": 2},
     [["GET"], ["POST", "GET"]], [["GET", "GET"], ["GET", "PUT", "POST"], ["get"]]),
    ({"type": "object", "properties": {"path": STR, "secret": STR, "configMap": STR},
      "required": ["path"], "additionalProperties": False,
      "oneOf": [{"required": ["secret"]}, {"required": ["configMap"]}]},
     [{"path": "p", "secret": "s"}, {"path": "p", "configMap": "c"}],
     [{"path": "p"}, {"path": "p", "secret": "s", "configMap": "c"}, "x"]),
    ({"additionalProperties": False, "properties": {"a": STR, "b": STR, "x": INT},
      "oneOf": [{"required": ["a"]}, {"required": ["b"]}, {"required": ["a", "x"]}]},
     [{"a": "s"}, {"b": "s"}, {"b": "s", "x": 1}],
     [{"a": "s", "x": 1}, {"a": "s", "b": "t"}, 5, {}]),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "allOf": [
        {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {"anyOf": [{"properties": {"a": {"minimum": 0}}}, {"properties": {"b": {"maximum": 0}}}]}]},
     [{"a": 1}, {"b": -1}, {"a": -1, "b": -1}], [{}, {"a": -1, "b": 1}, {"a": "1"}]),
]  # fmt: skip

# (schema, path of the refused keyword, words of the message): not exact, still refused
STILL_REFUSED = [
    ({"allOf": [{"$ref": "#/$defs/o"}, {"properties": {"x": {"type": "string",
      "pattern": "(?=a)"}}}], "$defs": {"o": {"type": "object"}}},
     "allOf[1].properties.x.pattern", "lookahead"),
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "a^b"}},
      "anyOf": [{"required": ["x"]}]}, "properties.x.pattern", "'^'"),
    ({"allOf": [{"type": "object", "properties": {"a": INT}, "additionalProperties": False},
                {"required": ["b"]}]}, "allOf", "allOf with several schemas"),
    ({"type": "object", "properties": {"next": {"$ref": "#", "required": ["v"]}, "v": INT}},
     "properties.next.required", "beside $ref"),
    ({"allOf": [{"properties": {"a": INT}}, {"properties": {"b": {
        "$ref": "#/allOf/0/properties/a"}}}]}, "allOf", "allOf with several schemas"),
    ({"type": "array", "items": STR, "uniqueItems": True}, "uniqueItems", "uniqueItems"),
    ({"type": "array", "items": {"enum": list(range(6))}, "uniqueItems": True}, "uniqueItems",
     "uniqueItems"),
    ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False,
      "allOf": [{"properties": {"b": INT}}]}, "type", "type beside allOf"),
]  # fmt: skip

NAMES = ["a", "b", "x", "y", "n", "name", "kind", "src", "handle", "v"]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-30, 30) | st.sampled_from([0.5, 6.0, 2.5])
    | st.sampled_from(["", "a", "ab", "abcdef", "red", "#00ff00", "b", "de", "int", "GET", "x"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(NAMES), inner,
                                                                 max_size=4),
    max_leaves=8,
)  # fmt: skip


_VALIDATORS: dict[str, Any] = {}


def _validator(schema):
    key = json.dumps(schema, sort_keys=True)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = jsonschema.validators.validator_for(schema)(schema)
    return _VALIDATORS[key]


def _agree(original, rewritten, instance) -> None:
    a, b = _validator(original).is_valid(instance), _validator(rewritten).is_valid(instance)
    assert a == b, f"{instance!r}: original {a}, rewritten {b}"


_VOCAB = [chr(c) for c in range(32, 127)] + ["</s>"]
# structure characters (and the stop token) are favoured, so that strings end
_WEIGHTS = torch.tensor([40.0 if c == '"' else 10.0 if c in '{}[],:-0123456789etfn</s>' else 1.0
                         for c in _VOCAB])  # fmt: skip


def _grammar_samples(schema, n: int, seed: int = 0) -> list:
    """Up to ``n`` JSON texts drawn at random from the grammar the engine compiles for
    ``schema`` (one character per token; structure characters favoured, so strings end)."""
    info = xgr.TokenizerInfo(_VOCAB, stop_token_ids=[len(_VOCAB) - 1])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        exact_schema_text(json.dumps(schema)), any_whitespace=False, strict_mode=True
    )
    gen, out = torch.Generator().manual_seed(seed), []
    mask, bits = xgr.allocate_token_bitmask(1, len(_VOCAB)), torch.arange(32, dtype=torch.int32)
    for _ in range(n):
        matcher, text = xgr.GrammarMatcher(compiled), ""
        while not matcher.is_terminated() and len(text) < 200:
            matcher.fill_next_token_bitmask(mask)
            allowed = ((mask[0].unsqueeze(-1) >> bits) & 1).flatten()[: len(_VOCAB)]
            token = int(torch.multinomial(_WEIGHTS * allowed, 1, generator=gen))
            assert matcher.accept_token(token)
            text += _VOCAB[token] if token != len(_VOCAB) - 1 else ""
        if matcher.is_terminated():
            out.append(json.loads(text))
    return out


@pytest.mark.parametrize("schema, valid, invalid", REWRITTEN)
def test_a_rewritten_schema_accepts_exactly_what_the_original_accepts(schema, valid, invalid):
    rewritten = rewrite_schema(schema)
    assert rewritten != schema
    xgrammar_check("json_schema", json.dumps(schema))  # no longer refused
    original = _validator(schema)
    for instance in valid:
        assert original.is_valid(instance), instance  # the cases themselves are right
        _agree(schema, rewritten, instance)
    for instance in invalid:
        assert not original.is_valid(instance), instance
        _agree(schema, rewritten, instance)
    samples = _grammar_samples(schema, 30)
    assert len(samples) >= 15
    for instance in samples:  # what the grammar produces meets the schema as given
        assert original.is_valid(instance), instance


@pytest.mark.parametrize("schema", [s for s, _, _ in REWRITTEN])
@settings(max_examples=50, deadline=None)
@given(instance=JSON)
def test_rewritten_and_original_agree_on_random_values(schema, instance):
    _agree(schema, rewrite_schema(schema), instance)


@pytest.mark.parametrize("schema, path, words", STILL_REFUSED)
def test_what_has_no_exact_rewrite_is_still_refused_at_its_original_path(schema, path, words):
    with pytest.raises(UnsupportedSchema) as e:
        check_schema_support(schema)
    assert e.value.path == path and words in e.value.detail, e.value
    rewritten = rewrite_schema(schema)
    for instance in [{}, {"a": 1, "b": 2}, {"next": {}}, ["a", "a"], [1, 1], {"x": "a"}]:
        _agree(schema, rewritten, instance)


def test_the_rewrite_leaves_its_input_unchanged_and_is_deterministic():
    schema, _, _ = REWRITTEN[8]
    before = json.dumps(schema, sort_keys=True)
    first = exact_schema_text(json.dumps(schema))
    assert json.dumps(schema, sort_keys=True) == before
    assert exact_schema_text(json.dumps(schema)) == first


def test_keywords_beside_ref_stay_ignored_in_draft_7():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              "definitions": {"s": STR}, "$ref": "#/definitions/s", "minLength": 3}  # fmt: skip
    assert rewrite_schema(schema) == schema  # minLength is ignored there: nothing to merge
    _agree(schema, rewrite_schema(schema), "a")


def test_unique_items_over_too_many_selections_is_not_enumerated():
    values = ["a", "b", "c", "d", "e"]  # 326 ordered selections
    schema = {"type": "array", "items": {"enum": values}, "uniqueItems": True}
    assert rewrite_schema(schema) == schema
    small = {**schema, "maxItems": 2}  # 1 + 5 + 20 = 26
    assert len(rewrite_schema(small)["enum"]) == 26 <= UNIQUE_LIMIT
