"""Patterns without lookaheads, ``not`` of listed strings as a pattern: the rewritten pattern
matches exactly the strings the original does (Python's ``re`` on the original, over many
generated strings), the grammar the server compiles takes exactly the values ``jsonschema``
accepts, and what has no exact form stays refused."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from radixserve.structured.grammar import check_grammar, grammar_backend
from radixserve.structured.regex_ast import RegexUnsupported
from radixserve.structured.regex_exclude import excluding, without_lookahead
from testing.grammar_walk import xgrammar_judge

ALPHABET = "ab@-._$xyz1A"


def _strings(alphabet: str, count: int, longest: int, seed: int = 0) -> set[str]:
    rng = random.Random(seed)
    return {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, longest)))
            for _ in range(count)}  # fmt: skip


@pytest.mark.parametrize("pattern, extra", [
    ("^(?!@@)[@a-zA-Z0-9_-]+$", ["@@", "@", "@a"]),
    ("^(?!org\\.bukkit\\.)([a-zA-Z_$][a-zA-Z\\d_$]*\\.)*[a-zA-Z_$][a-zA-Z\\d_$]*$",
     ["org.bukkit.a", "org.bukkit", "org.bukki.a", "org.x", "a.org.bukkit.b"]),
    ("^(?!ab|a|xyz)[a-z]{0,4}$", ["", "a", "ab", "b", "xy", "xyz", "xyza"]),
    ("^(?=ab|c)[a-c]*(?:x|yz?)?$", ["ab", "c", "a", "abyz", "cx", "bx"]),
    ("^(?!a)(?:a|b)+?b{1,3}$", ["ab", "bb", "abb", "bbbb"]),
])  # fmt: skip
def test_a_pattern_without_its_lookahead_matches_the_same_strings(pattern, extra):
    plain = without_lookahead(pattern)
    assert "(?=" not in plain and "(?!" not in plain
    strings = _strings(ALPHABET, 4000, 14) | set(extra)
    matched = [s for s in strings if re.search(pattern, s)]
    assert len(matched) > 20 or extra  # the comparison sees both outcomes
    for s in strings:
        assert bool(re.fullmatch(plain, s)) == bool(re.search(pattern, s)), (s, plain)


@pytest.mark.parametrize("pattern, words", [
    (None, ["swagger-codegen"]),
    (None, ["", "ab", "a"]),
    ("^[A-Za-z_][A-Za-z0-9_]*(\\.[A-Za-z_][A-Za-z0-9_]*)*$", ["null", "int", "x.y"]),
])  # fmt: skip
def test_a_pattern_excluding_words_matches_everything_else(pattern, words):
    plain = excluding(pattern, words)
    strings = _strings("abxy._-sw" + "".join(words), 3000, 10) | set(words) | {"\n", "a\nb"}
    for s in strings:
        expected = s not in words and (pattern is None or re.search(pattern, s) is not None)
        assert bool(re.fullmatch(plain, s)) == expected, (s, plain)


@pytest.mark.parametrize("pattern", [
    "^(?!.*--)[a-z-]+$",  # not a list of words
    "^a(?!b)\\w+$",  # not at the start
    "(?!a)b+$",  # not anchored at the start
    "^(?!a)b+",  # not anchored at the end
    "^(?!a)b(?=c)c$",  # a second lookahead
])  # fmt: skip
def test_lookaheads_without_an_exact_form_stay_as_they_are(pattern):
    with pytest.raises(RegexUnsupported):
        without_lookahead(pattern)
    schema = {"type": "string", "pattern": pattern}
    with pytest.raises(ValueError, match="lookahead"):
        check_grammar("json_schema", json.dumps(schema))


def _agree(schema: dict, values) -> None:
    """The grammar takes a value exactly when ``jsonschema`` accepts it (both seen)."""
    judge, seen = xgrammar_judge(schema), set()
    for v in values:
        valid = jsonschema.Draft7Validator(schema).is_valid(v)
        assert judge(v) == valid, (v, valid)
        seen.add(valid)
    assert seen == {True, False}


def test_pattern_properties_with_a_lookahead_are_enforced_exactly():
    entry = {"type": "object", "properties": {"m": {"type": "integer"}}, "required": ["m"],
             "additionalProperties": False}  # fmt: skip
    schema = {"type": "object", "additionalProperties": False,
              "patternProperties": {"^(?!@@)[@a-z_-]+$": entry}}  # fmt: skip
    assert grammar_backend("json_schema", json.dumps(schema)) == "xgrammar"
    keys = _strings("@ab_-", 150, 5, seed=1) | {"@@", "@", "@a", "a@@"}
    _agree(schema, [{k: {"m": 1}} for k in keys] + [{"ab": {"m": 1}, "@@x": {"m": 2}}])


def test_not_of_listed_strings_is_a_pattern_and_makes_one_of_exclusive():
    names = {"type": "string", "enum": ["null", "int", "string"]}
    custom = {"not": {"$ref": "#/definitions/names"}, "type": "string",
              "pattern": "^[a-z_][a-z0-9_]*(\\.[a-z_][a-z0-9_]*)*$"}  # fmt: skip
    schema = {"definitions": {"names": names, "custom": custom},
              "oneOf": [{"$ref": "#/definitions/names"}, {"$ref": "#/definitions/custom"},
                        {"type": "object", "properties": {"type": {"$ref": "#/definitions/names"}},
                         "required": ["type"]}]}  # fmt: skip
    assert grammar_backend("json_schema", json.dumps(schema)) == "xgrammar"
    words = _strings("intsrgul.", 300, 7, seed=2) | {"null", "int", "string", "in", "intx"}
    _agree(schema, [*words, *({"type": w} for w in ("int", "null", "x")), 3])


def test_not_of_other_schemas_stays_refused():
    schema = {"type": "string", "not": {"type": "string", "minLength": 3}}
    with pytest.raises(ValueError, match="not is not supported"):
        check_grammar("json_schema", json.dumps(schema))


def test_one_of_listed_values_and_a_pattern_that_matches_one_stays_refused():
    schema = {"oneOf": [{"enum": ["int", "x.y"]}, {"type": "string", "pattern": "^[a-z]+$"}]}
    with pytest.raises(ValueError, match="oneOf"):
        check_grammar("json_schema", json.dumps(schema))
    exclusive = {"oneOf": [{"enum": ["x.y", "a b"]}, {"type": "string", "pattern": "^[a-z]+$"}]}
    assert grammar_backend("json_schema", json.dumps(exclusive)) == "xgrammar"


@pytest.fixture(scope="module")
def llguidance_judge(default_tokenizer):
    """Whether llguidance's grammar for a schema takes a value's JSON text (then the end)."""
    from radixserve.structured.llguidance_backend import LLGuidanceBackend

    backend, tok = LLGuidanceBackend(), default_tokenizer.hf
    vocabulary = backend.vocabulary(tok, 49152, [2])

    def judge(schema: dict):
        prepared = backend.prepare("json_schema", json.dumps(schema)).text
        grammar = vocabulary.compile("json_schema", prepared)

        def takes(value) -> bool:
            m = vocabulary.matcher(grammar)
            tokens = [*tok.encode(json.dumps(value), add_special_tokens=False), 2]
            return all(m.accept(t) for t in tokens)

        return takes

    return judge


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 1, "pattern": "^(?!ab|a@)[a-z@ ]{0,4}$"},
    {"type": "string", "maxLength": 4, "not": {"enum": ["ab", "a b", "b"]}},
])  # fmt: skip
def test_rewritten_patterns_bind_llguidance_exactly_too(llguidance_judge, schema):
    assert grammar_backend("json_schema", json.dumps(schema)) == "llguidance"
    takes, seen = llguidance_judge(schema), set()
    for s in _strings("ab@ ", 150, 5, seed=4) | {"ab", "a@", "a", "", "b", "a b"}:
        valid = jsonschema.Draft7Validator(schema).is_valid(s)
        assert takes(s) == valid, (s, valid)
        seen.add(valid)
    assert seen == {True, False}
