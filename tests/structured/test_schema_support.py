"""The schema support check: each construct the grammar compiles only approximately is
refused with its JSON path, and for each the grammar really does accept a JSON text the
schema refuses (so the refusal is needed, and the list follows the pinned xgrammar); the
exact constructs beside them, exclusive ``oneOf`` included, are accepted."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from radixserve.structured.schema_support import UnsupportedSchema, check_schema_support
from radixserve.structured.xgrammar_backend import XGrammarBackend

check_grammar = XGrammarBackend().prepare  # xgrammar alone: what it enforces, or its refusal

OBJ = {"type": "object"}
INT = {"type": "integer"}
STR = {"type": "string"}

# (schema, path of the refused keyword, words of the message, a text the grammar takes that
# the schema refuses)
REFUSED = [
    ({"type": "string", "pattern": "^[a-z](?=a)[a-z]+$"}, "pattern", "lookahead (?=...)", '"bb"'),
    ({"type": "string", "pattern": "^(?!.*a)[a-z]+$"}, "pattern", "negative lookahead", '"ba"'),
    ({"type": "string", "pattern": "^a(b$)c"}, "pattern", "'$'", '"abc"'),
    ({"type": "string", "pattern": "x(^a)"}, "pattern", "'^'", '"xa"'),
    ({"type": "string", "format": "email", "maxLength": 5}, "maxLength",
     "beside format 'email'", '"abcdef@x.com"'),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "minLength", "beside pattern",
     '"a"'),
    ({"type": "string", "format": "date", "pattern": "^2020"}, "pattern", "beside format",
     '"2021-01-01"'),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "multipleOf 0.5", "0.3"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf", "one-sided", "4"),
    ({"oneOf": [INT, {"type": "number"}]}, "oneOf", "branches 0 and 1 may overlap", "1"),
    ({"oneOf": [{"properties": {"k": {"const": 1}}, "required": ["k"]},
                {"properties": {"k": {"const": 1}, "x": INT}}]}, "oneOf",
     "branches 0 and 1 may overlap", '{"k":1}'),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "allOf",
     "allOf with several schemas", '3'),
    ({"type": "integer", "not": {"const": 1}}, "not", "not is not supported", "1"),
    ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "if", "if/then/else",
     "9"),
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", "uniqueItems",
     "[1,1]"),
    ({"type": "array", "items": INT, "contains": {"const": 5}}, "contains", "contains", "[1]"),
    ({"type": "object", "properties": {"b": INT}, "required": ["a"],
      "additionalProperties": True}, "required",
     "required property 'a' that is not in properties", '{"b":1}'),
    ({"type": "object", "properties": {"xa": STR}, "patternProperties": {"^x": INT}},
     "patternProperties.^x", "matches the property 'xa'", '{"xa":"s"}'),
    ({"type": "object", "properties": {"a": INT}, "propertyNames": {"pattern": "^x"}},
     "propertyNames", "the listed property 'a'", '{"a":1}'),
    ({"pattern": "^a", "anyOf": [{"type": "string", "pattern": "b$"}]}, "pattern",
     "pattern beside anyOf", '"b"'),
    ({"anyOf": [{"required": ["a"]}]}, "anyOf[0].required", "without a type", "{}"),
    ({"type": "string", "enum": ["a", 1]}, "enum", "not of the type", "1"),
    ({"type": "object", "properties": {"p": {"minimum": 3}}}, "properties.p.minimum",
     "without a type", '{"p":1}'),
    ({"$defs": {"s": {"type": "string", "pattern": "^a"}}, "$ref": "#/$defs/s",
      "pattern": "b$"}, "pattern", "beside $ref", '"a"'),
    ({"$defs": {"p": {"type": "string", "pattern": "a^b"}}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/p"}}, "required": ["x"]}, "$defs.p.pattern", "'^'",
     '{"x":"ab"}'),
]  # fmt: skip

ACCEPTED = [
    {"oneOf": [STR, INT, {"type": "null"}]},
    {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},
    {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": INT},
         "required": ["kind", "lives"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"enum": ["dog", "fox"]}, "name": STR},
         "required": ["kind"], "additionalProperties": False},
    ]},
    {"$defs": {"a": {"type": "object", "properties": {"t": {"const": 1}}, "required": ["t"]},
               "b": {"type": "object", "properties": {"t": {"const": 2}}, "required": ["t"]}},
     "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]},
    {"type": "array", "items": {"oneOf": [  # JSON Patch: untyped objects told apart by "op"
        {"properties": {"op": {"enum": ["add", "test"]}, "value": {}}, "required": ["op"],
         "additionalProperties": False},
        {"properties": {"op": {"const": "remove"}}, "required": ["op"],
         "additionalProperties": False}]}},
    {"oneOf": [  # each requires a key the other closes out
        {"type": "object", "properties": {"name": STR}, "required": ["name"],
         "additionalProperties": False},
        {"type": "object", "properties": {"path": STR}, "required": ["path"],
         "additionalProperties": False}]},
    {"type": "object", "anyOf": [{"type": "object", "properties": {"a": INT}}]},
    {"anyOf": [STR, {"type": "null"}], "minimum": 3, "title": "t", "default": None},
    {"type": ["string", "null"], "enum": ["a", None]},
    {"type": "string", "pattern": "^(a|b)$|^c$", "format": "unknown"},
    {"type": "string", "format": "unknown", "minLength": 2, "maxLength": 4},
    {"type": "string", "format": "date", "minLength": 0},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    {"type": "array", "items": INT, "uniqueItems": True, "maxItems": 1},
    {"type": "string", "contains": {"const": 1}, "dependencies": {"a": ["b"]}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"s": STR},
     "$ref": "#/definitions/s", "minLength": 3},
    {"definitions": {"unused": {"type": "string", "pattern": "(?=x)"}}, "type": "object",
     "properties": {"a": INT, "self": {"$ref": "#"}}, "required": ["a"]},
    {"type": "object", "properties": {"xa": STR}, "patternProperties": {"^y": INT},
     "propertyNames": {"pattern": "^[xy]"}},
]  # fmt: skip


def _grammar_accepts(schema: dict, text: str) -> bool:
    """Whether the grammar the engine compiles takes ``text`` (written with the grammar's
    separators, ", " and ": ")."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return _is_grammar_accept_string(grammar, json.dumps(json.loads(text)))


@pytest.mark.parametrize("schema, path, words, witness", REFUSED)
def test_each_approximate_construct_is_refused_with_its_path(schema, path, words, witness):
    with pytest.raises(UnsupportedSchema) as e:
        check_grammar("json_schema", json.dumps(schema))
    assert e.value.path == path and words in e.value.detail, e.value
    # the refusal is needed: the grammar takes a text the schema refuses
    assert _grammar_accepts(schema, witness)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(witness), schema)


@pytest.mark.parametrize("schema", ACCEPTED)
def test_exact_constructs_are_accepted(schema):
    check_grammar("json_schema", json.dumps(schema))


def test_a_reference_outside_the_schema_is_refused():
    with pytest.raises(UnsupportedSchema, match="only references inside") as e:
        check_grammar("json_schema", json.dumps({"$ref": "https://example.com/s.json"}))
    assert e.value.path == "$ref"


def test_regex_grammars_get_the_same_anchor_check():
    with pytest.raises(UnsupportedSchema, match="'\\^'"):
        check_grammar("regex", "x(^a)")
    assert _is_grammar_accept_string(xgr.Grammar.from_regex("x(^a)"), "xa")  # yet "xa" fails
    check_grammar("regex", "^[a-z]+$|^[0-9]+$")


def test_a_recursive_schema_is_walked_once_per_reference():
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        "name": {"type": "string", "pattern": "a$b"}}}}, "$ref": "#/$defs/node"}  # fmt: skip
    with pytest.raises(UnsupportedSchema) as e:
        check_schema_support(schema)
    assert e.value.path == "$defs.node.properties.name.pattern"
