"""``if``/``then``/``else`` on a discriminator, rewritten into the ``anyOf`` of its cases: the
key a case forbids is masked out once the discriminator is written, the same schema without
the conditions allows it, and generated outputs validate."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from radixserve.engine import SamplingParams
from radixserve.structured.grammar import GrammarCompiler, check_grammar
from testing.grammar_walk import allowed, matcher_after, xgrammar_judge

VOCAB = 49152
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
STR = {"type": "string"}
ACCESS = {"type": "object", "required": ["kind"], "additionalProperties": False,
          "properties": {"kind": {"enum": ["open", "secure"]}, "user": DIGIT},
          "allOf": [{"if": {"properties": {"kind": {"const": "secure"}}},
                     "then": {"required": ["user"]},
                     "else": {"properties": {"user": False}}}]}  # fmt: skip


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    c = GrammarCompiler(default_tokenizer.hf, VOCAB, [2])
    yield c
    c.close()


def test_the_case_decides_which_keys_may_follow(compiler, default_tokenizer):
    tok = default_tokenizer.hf
    [close] = tok.encode("}", add_special_tokens=False)
    [comma] = tok.encode(",", add_special_tokens=False)
    free = {k: v for k, v in ACCESS.items() if k != "allOf"}
    m = matcher_after(compiler, tok, ACCESS, '{"kind": "open"')
    assert allowed(m, VOCAB)[close] and not allowed(m, VOCAB)[comma]  # no user when open
    assert allowed(matcher_after(compiler, tok, free, '{"kind": "open"'), VOCAB)[comma]
    m = matcher_after(compiler, tok, ACCESS, '{"kind": "secure"')
    assert allowed(m, VOCAB)[comma] and not allowed(m, VOCAB)[close]  # user required
    assert allowed(matcher_after(compiler, tok, free, '{"kind": "secure"'), VOCAB)[close]


def test_conditions_on_a_key_with_a_test_that_lists_no_values_stay_refused():
    schema = {**ACCESS, "properties": {**ACCESS["properties"], "kind": {"type": "string"}},
              "allOf": [{"if": {"properties": {"kind": {"minLength": 3}}},
                         "then": {"required": ["user"]}}]}  # fmt: skip
    with pytest.raises(ValueError, match="if is not supported"):
        check_grammar("json_schema", json.dumps(schema))


# a chain of else on a key that may be absent, tested by an anyOf of a const and null
STEP = {"type": "object", "additionalProperties": False,
        "properties": {"type": {"enum": [None, "run", "push", "load"]}, "command": STR,
                       "image": STR, "steps": {"type": "array", "items": STR}},
        "if": {"properties": {"type": {"anyOf": [{"const": "run"}, {"type": "null"}]}}},
        "then": {"required": ["command"], "properties": {"image": {"type": "null"}}},
        "else": {"if": {"properties": {"type": {"const": "push"}}},
                 "then": {"required": ["image"], "properties": {"command": {"type": "null"}}},
                 "else": {"properties": {"steps": {"type": "null"}}}}}  # fmt: skip
# a condition on a key that takes any string: the other strings are one more case
TOOL = {"type": "object", "required": ["kind"],
        "properties": {"kind": STR, "level": {"type": "integer", "minimum": 0, "maximum": 3}},
        "allOf": [{"if": {"properties": {"kind": {"const": "deep"}}},
                   "then": {"required": ["level"]},
                   "else": {"properties": {"level": False}}}]}  # fmt: skip


def _objects(keys: dict, seed: int) -> list[dict]:
    """Objects of some of ``keys``, each with one of its listed values."""
    rng = random.Random(seed)
    out = []
    for _ in range(300):
        chosen = [k for k in keys if rng.random() < 0.5]
        out.append({k: rng.choice(keys[k]) for k in chosen})
    return out


@pytest.mark.parametrize("schema, keys", [
    (STEP, {"type": [None, "run", "push", "load"], "command": ["ls", None],
            "image": ["x", None], "steps": [["a"], None]}),
    (TOOL, {"kind": ["deep", "dee", "deeper", "", "wide"], "level": [0, 2]}),
])  # fmt: skip
def test_the_cases_take_exactly_what_the_conditions_allow(schema, keys):
    judge = xgrammar_judge(schema)
    seen = set()
    for value in _objects(keys, seed=len(keys)):
        valid = jsonschema.Draft7Validator(schema).is_valid(value)
        assert judge(value) == valid, (value, valid)
        seen.add(valid)
    assert seen == {True, False}


def test_generated_outputs_validate(make_engine):
    engine = make_engine()
    outs: dict[str, list[int]] = {str(seed): [] for seed in range(4)}
    reasons = {}
    for rid in outs:
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=int(rid))
        engine.add_request(rid, [1, 2, 3, 4], params, grammar=("json_schema", json.dumps(ACCESS)))
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert all(why == "stop" for why in reasons.values()), reasons
    for rid in outs:
        jsonschema.validate(json.loads(engine.tokenizer.decode(outs[rid])), ACCESS)
