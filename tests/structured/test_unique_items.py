"""Distinct items (``uniqueItems``) enforced beside the grammar: every token that would
complete an item equal to an earlier one is masked out (and refused by ``accept``), the
same grammar without the tracker allows it, drafts roll back exactly, and generation with
the engine, pushed hard towards repeating items, still yields outputs that validate."""

from __future__ import annotations

import json

import pytest
import torch

from radixserve.engine import SamplingParams
from radixserve.structured.grammar import GrammarCompiler, check_grammar
from testing import grammar_walk as walk

STR = {"type": "string"}
VOCAB = 49152
STRINGS = {"type": "array", "items": STR, "uniqueItems": True, "minItems": 3, "maxItems": 4}
RECORDS = {"type": "array", "uniqueItems": True, "minItems": 3, "maxItems": 3,
           "items": {"type": "object", "properties": {"name": STR, "tag": STR},
                     "required": ["name", "tag"], "additionalProperties": False}}  # fmt: skip
LISTED = {"type": "array", "items": {"enum": [1, 2, 3, 4, 5, 6]}, "uniqueItems": True,
          "minItems": 4}  # fmt: skip
ANY_VALUES = {"type": "array", "uniqueItems": True, "minItems": 3, "maxItems": 3}
NESTED = {"type": "object", "properties": {"tags": {**STRINGS, "minItems": 2}},
          "required": ["tags"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    c = GrammarCompiler(default_tokenizer.hf, VOCAB, [2])
    yield c
    c.close()


def matcher_after(compiler, tokenizer, schema, text: str):
    return walk.matcher_after(compiler, tokenizer.hf, schema, text)


def allowed(m) -> torch.Tensor:
    return walk.allowed(m, VOCAB)


# (schema, text so far, a next text that would repeat an item, one that would not)
BINDS = [
    (STRINGS, '["ab", "ab', '"', "c"),
    (STRINGS, '["ab", "ab', '",', "c"),
    (STRINGS, '["a ", "a', ' "', "c"),  # the token closing the string holds its last byte
    (RECORDS, '[{"name": "x", "tag": "y"}, {"name": "x", "tag": "y', '"', "z"),
    (LISTED, "[1, 2, ", "2", "3"),
    (ANY_VALUES, "[true, ", "true", "false"),
    (NESTED, '{"tags": ["ab", "ab', '"', "c"),
]  # fmt: skip


@pytest.mark.parametrize("schema, prefix, repeat, other", BINDS)
def test_a_token_that_would_repeat_an_item_is_impossible(compiler, default_tokenizer, schema,
                                                         prefix, repeat, other):  # fmt: skip
    tok = default_tokenizer.hf
    [bad] = tok.encode(repeat, add_special_tokens=False)
    [good] = tok.encode(other, add_special_tokens=False)
    m = matcher_after(compiler, default_tokenizer, schema, prefix)
    mask = allowed(m)
    assert not mask[bad] and mask[good]
    assert not m.accept(bad)  # refused, and the matcher is where it was
    assert m.accept(good)
    # the grammar alone takes it: the tracker is what binds
    free = (
        {**schema, "uniqueItems": False}
        if schema is not NESTED
        else {
            **NESTED,
            "properties": {"tags": {**NESTED["properties"]["tags"], "uniqueItems": False}},
        }
    )
    assert allowed(matcher_after(compiler, default_tokenizer, free, prefix))[bad]


def test_a_rolled_back_draft_restores_the_items_written(compiler, default_tokenizer):
    tok = default_tokenizer.hf
    m = matcher_after(compiler, default_tokenizer, STRINGS, '["ab", "')
    before = allowed(m)
    draft = tok.encode('cd", "', add_special_tokens=False)
    for t in draft:
        assert m.accept(t)
    [close] = tok.encode('"', add_special_tokens=False)
    for t in tok.encode("cd", add_special_tokens=False):
        assert m.accept(t)
    assert not allowed(m)[close]  # "cd" is written now
    m.rollback(len(draft) + len(tok.encode("cd", add_special_tokens=False)))
    assert torch.equal(allowed(m), before)
    for t in tok.encode('cd"', add_special_tokens=False):
        assert m.accept(t)  # "cd" was never kept: it may be written


def test_what_the_tracker_cannot_keep_distinct_is_refused_naming_it():
    tuple_items = {"type": "array", "prefixItems": [STR, STR], "uniqueItems": True}
    with pytest.raises(ValueError, match="uniqueItems over a tuple"):
        check_grammar("json_schema", json.dumps(tuple_items))
    bounded = {"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True}
    with pytest.raises(ValueError, match="uniqueItems is not supported on these items"):
        check_grammar("json_schema", json.dumps(bounded))


QUOTES = ('"', '",', '"]', '""', '"}', " true", "true")


def test_generated_outputs_pushed_to_repeat_items_validate(make_engine):
    """Logit bias pulls the model to close every string at once and to write the same
    literal, so without the tracker its items repeat; with it every output validates."""
    engine = make_engine()
    tok = engine.tokenizer.hf
    bias = {t: 8.0 for q in QUOTES for t in tok.encode(q, add_special_tokens=False)}
    schemas = {f"{i}-{seed}": s for i, s in enumerate([STRINGS, RECORDS, LISTED, ANY_VALUES,
                                                        NESTED]) for seed in range(2)}  # fmt: skip
    params = lambda rid: SamplingParams(max_tokens=64, temperature=0.7, seed=int(rid[-1]),
                                        logit_bias=bias)  # fmt: skip # noqa: E731
    reasons = walk.generate_and_validate(engine, schemas, params)
    assert sum(why == "stop" for why in reasons.values()) >= 6, reasons
