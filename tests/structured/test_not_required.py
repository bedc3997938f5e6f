"""``not`` of ``required`` (some listed key is absent) and dependencies (a key brings others),
rewritten into branches that close a key out: the key that would complete a forbidden set is
masked out, a key's dependency is forced, the same schemas without them allow otherwise,
and generated outputs validate."""

from __future__ import annotations

import pytest

from radixserve.engine import SamplingParams
from radixserve.structured.grammar import GrammarCompiler
from testing.grammar_walk import allowed, generate_and_validate, matcher_after

VOCAB = 49152
INT = {"type": "integer", "minimum": 0, "maximum": 9}
PAIR = {"type": "object", "properties": {"payload": INT, "form": INT, "id": INT},
        "required": ["id"], "additionalProperties": False,
        "not": {"required": ["payload", "form"]}}  # fmt: skip
NEITHER = {"type": "object", "properties": {"env": INT, "mode": INT}, "required": ["mode"],
           "allOf": [{"not": {"properties": {"env": {}}, "required": ["env"]}}]}  # fmt: skip

DEPENDS = {"type": "object", "properties": {"a": INT, "b": INT}, "additionalProperties": False,
           "dependencies": {"a": ["b"]}}  # fmt: skip


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    c = GrammarCompiler(default_tokenizer.hf, VOCAB, [2])
    yield c
    c.close()


@pytest.mark.parametrize("schema, prefix, key", [
    (PAIR, '{"payload": 1, "', "form"),
    (NEITHER, '{"', "env"),
])  # fmt: skip
def test_a_key_completing_a_forbidden_set_is_impossible(compiler, default_tokenizer, schema,
                                                        prefix, key):  # fmt: skip
    tok = default_tokenizer.hf
    first = tok.encode(key, add_special_tokens=False)[0]
    assert not allowed(matcher_after(compiler, tok, schema, prefix), VOCAB)[first]
    free = {k: v for k, v in schema.items() if k not in ("not", "allOf")}
    assert allowed(matcher_after(compiler, tok, free, prefix), VOCAB)[first]


def test_a_key_brings_its_dependency(compiler, default_tokenizer):
    tok = default_tokenizer.hf
    [close] = tok.encode("}", add_special_tokens=False)
    assert not allowed(matcher_after(compiler, tok, DEPENDS, '{"a": 1'), VOCAB)[close]
    free = {k: v for k, v in DEPENDS.items() if k != "dependencies"}
    assert allowed(matcher_after(compiler, tok, free, '{"a": 1'), VOCAB)[close]


def test_generated_outputs_validate(make_engine):
    engine = make_engine()
    schemas = {
        f"{i}-{seed}": s for i, s in enumerate([PAIR, NEITHER, DEPENDS]) for seed in range(2)
    }
    reasons = generate_and_validate(
        engine,
        schemas,
        lambda rid: SamplingParams(max_tokens=40, temperature=1.0, seed=int(rid[-1])),
    )
    assert sum(why == "stop" for why in reasons.values()) >= 2, reasons
