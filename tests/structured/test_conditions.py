"""``if``/``then``/``else`` on a discriminator, rewritten into the ``anyOf`` of its cases: the
key a case forbids is masked out once the discriminator is written, the same schema without
the conditions allows it, and generated outputs validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from radixserve.engine import SamplingParams
from radixserve.structured.grammar import GrammarCompiler, check_grammar
from testing.grammar_walk import allowed, matcher_after

VOCAB = 49152
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
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


def test_conditions_on_a_free_key_stay_refused():
    schema = {**ACCESS, "properties": {**ACCESS["properties"], "kind": {"type": "string"}}}
    with pytest.raises(ValueError, match="else is not supported"):
        check_grammar("json_schema", json.dumps(schema))


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
