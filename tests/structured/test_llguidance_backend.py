"""The second grammar backend: which schemas go to llguidance, which neither backend takes
(and that llguidance itself really refuses them, or takes a text the schema refuses), that
what it compiles only produces valid JSON, and its masks with drafts."""

from __future__ import annotations

import json
from concurrent.futures import Future

import jsonschema
import llguidance as llg
import pytest
import torch

from radixserve.structured import GrammarStats, UnsupportedSchema, check_grammar, grammar_backend
from radixserve.structured.backend import allocate_bitmask
from radixserve.structured.grammar import Compiled, GrammarState
from radixserve.structured.jump_forward import Drafter
from radixserve.structured.llguidance_backend import OPTIONS, LLGuidanceBackend

INT, STR = {"type": "integer"}, {"type": "string"}


def closed(**props):
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


# schemas xgrammar would not enforce exactly and llguidance does
LLGUIDANCE_ONLY = [
    closed(contact_email_address={"type": "string", "format": "email", "maxLength": 24},
           preferred_contact_hour={"type": "integer", "minimum": 8, "maximum": 18}),
    closed(repository_name={"type": "string", "pattern": "^[a-z][a-z0-9-]*$", "minLength": 3,
                            "maxLength": 20},
           default_branch_name={"enum": ["main", "trunk"]}, delete_branch_on_merge={
               "type": "boolean"}),
    closed(unit_price_in_euros={"type": "number", "multipleOf": 0.25, "minimum": 0,
                                "maximum": 100}, quantity_in_stock=INT),
    {"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}], "maxLength": 6},
    {"type": "object", "properties": {"upstream": STR}, "required": ["upstream", "branch"],
     "additionalProperties": {"type": "string", "maxLength": 4}},
]  # fmt: skip

# (schema, path, words): neither backend enforces it
REFUSED = [
    ({"type": "array", "prefixItems": [STR, STR], "uniqueItems": True}, "uniqueItems",
     "uniqueItems over a tuple"),
    ({"type": "object", "properties": {"x": {"not": {"const": 1}}}}, "properties.x.not", "not"),
    ({"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
     "if", "if is not supported"),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^\\w(?!a)\\w+$"}}},
     "properties.id.pattern", "negative lookahead"),
    ({"type": "object", "patternProperties": {"^(?!.*@@)[a-z@]+$": INT}},
     "patternProperties.^(?!.*@@)[a-z@]+$", "negative lookahead"),
    ({"type": "object", "properties": {"u": {"$ref": "https://example.com/u.json"}}},
     "properties.u.$ref", "outside the schema"),
    ({"oneOf": [STR, {"type": "string", "maxLength": 3}], "minLength": 1}, "oneOf", "overlap"),
    ({"type": "array", "items": {"type": "array", "contains": {"const": 1}}}, "items.contains",
     "contains"),
    ({"x-guidance": {"lenient": True, "coerce_one_of": True}, "type": "object",
      "properties": {"tags": {"type": "array", "uniqueItems": True, "items": {
          "type": "object", "properties": {"n": INT}}}}},
     "properties.tags.uniqueItems", "uniqueItems is not supported on these items"),
]  # fmt: skip
# a key matched by additionalProperties may repeat in llguidance's (and xgrammar's) grammar
REPEATED = {"type": "object", "additionalProperties": INT, "minProperties": 2}


def test_the_choice_is_xgrammar_first_then_llguidance_and_always_the_same():
    assert grammar_backend("json_schema", json.dumps(closed(a=INT, b=STR))) == "xgrammar"
    assert grammar_backend("regex", "[a-z]+") == grammar_backend("ebnf", 'root ::= "a"')
    for schema in LLGUIDANCE_ONLY:
        text = json.dumps(schema)
        assert [grammar_backend("json_schema", text) for _ in range(2)] == ["llguidance"] * 2


@pytest.mark.parametrize("schema, path, words", REFUSED)
def test_what_neither_backend_enforces_is_refused_naming_the_construct(schema, path, words):
    with pytest.raises(UnsupportedSchema) as e:
        check_grammar("json_schema", json.dumps(schema))
    assert e.value.path == path and words in e.value.detail, e.value
    # llguidance itself refuses it (an error, not a warning or a dropped keyword), even with
    # the options forced off that a schema's own x-guidance may ask for
    raw = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=OPTIONS)
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(raw, None)
    assert failed and messages


def test_repeatable_keys_under_min_properties_are_refused_because_they_repeat(default_tokenizer):
    with pytest.raises(UnsupportedSchema, match="may repeat") as e:
        check_grammar("json_schema", json.dumps(REPEATED))
    assert e.value.path == "minProperties"
    tokenizer = LLGuidanceBackend().vocabulary(default_tokenizer.hf, 49152, [2])._tokenizer
    raw = llg.LLMatcher.grammar_from_json_schema(json.dumps(REPEATED), overrides=OPTIONS)
    matcher = llg.LLMatcher(tokenizer, raw, log_level=0)
    witness = '{"a": 1, "a": 2}'  # the grammar takes it, the schema does not (one key once parsed)
    assert matcher.try_consume_tokens(tokenizer.tokenize_str(witness)) > 0
    assert matcher.is_accepting()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(witness), REPEATED)


def test_an_unknown_format_is_an_annotation_and_no_ops_are_dropped():
    schema = {"type": "object", "properties": {
        "link": {"type": "string", "format": "uri-reference", "maxLength": 30},
        "tags": {"type": "array", "items": STR, "uniqueItems": False}},
        "dependencies": {}, "$schema": "https://json-schema.org/draft-07/schema#"}  # fmt: skip
    assert grammar_backend("json_schema", json.dumps(schema)) == "llguidance"


@pytest.fixture(scope="module")
def vocabulary(default_tokenizer):
    return LLGuidanceBackend().vocabulary(default_tokenizer.hf, 49152, [2])


def compiled(vocabulary, schema) -> Compiled:
    prepared = LLGuidanceBackend().prepare("json_schema", json.dumps(schema))
    return Compiled("llguidance", vocabulary.compile("json_schema", prepared.text), vocabulary)


def allowed(bitmask: torch.Tensor, row: int) -> torch.Tensor:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1).bool()


@pytest.fixture(scope="module")
def structural(default_tokenizer):
    """Which tokens hold a character that ends or separates JSON values."""
    tok = default_tokenizer.hf
    return torch.tensor([bool(set(tok.decode([t])) & set('"}],:')) for t in range(len(tok))])


@pytest.mark.parametrize("index", range(len(LLGUIDANCE_ONLY)))
def test_texts_drawn_from_llguidance_grammars_validate(vocabulary, default_tokenizer,
                                                       structural, index):  # fmt: skip
    """Random walks through the grammar (structure tokens favoured, so strings end): every
    text the grammar completes validates against the schema as written."""
    schema, tok = LLGUIDANCE_ONLY[index], default_tokenizer.hf
    gen, done = torch.Generator().manual_seed(index), 0
    grammar = compiled(vocabulary, schema)
    mask = allocate_bitmask(1, 49152)
    for _ in range(10):
        m, out = grammar.matcher(), []
        while not m.terminated and len(out) < 60:
            m.fill(mask, 0)
            choices = allowed(mask, 0)
            ends = choices & structural
            pick = ends if ends.any() and torch.rand(1, generator=gen) < 0.6 else choices
            ids = pick.nonzero().flatten()
            t = int(ids[torch.randint(len(ids), (1,), generator=gen)])
            if t == 2:
                break
            assert m.accept(t)
            out.append(t)
        if m.terminated or allowed(mask, 0)[2]:
            jsonschema.validate(json.loads(tok.decode(out)), schema)
            done += 1
    assert done >= 3


def test_masks_of_draft_rows_are_the_masks_of_single_steps(vocabulary, default_tokenizer):
    """The row after each draft token gets the mask of the matcher moved over the draft, and
    ``settle`` rolls back what was not kept."""
    schema, tok = LLGUIDANCE_ONLY[1], default_tokenizer.hf
    future = Future()
    future.set_result(compiled(vocabulary, schema))
    stats = GrammarStats()
    drafter = Drafter(tok, [2], [tok.decode([t]).encode() for t in range(len(tok))])
    state = GrammarState(future, drafter, stats)
    prefix = tok.encode('{"repository_name": "ab', add_special_tokens=False)
    for t in prefix:
        state.fill_rows(allocate_bitmask(1, 49152), 0, [])
        state.settle(0, 0, t)
    draft = tok.encode('c", "default_branch_name": "', add_special_tokens=False)
    mask = allocate_bitmask(len(draft) + 1, 49152)
    state.fill_rows(mask, 0, draft)
    single = compiled(vocabulary, schema).matcher()
    one = allocate_bitmask(1, 49152)
    for row, token in enumerate([*prefix, *draft]):
        if row >= len(prefix):
            single.fill(one, 0)
            assert torch.equal(one[0], mask[row - len(prefix)])
        assert single.accept(token)
    single.fill(one, 0)
    assert torch.equal(one[0], mask[len(draft)])
    state.settle(len(draft), 2, draft[2])  # two kept, then the third drawn: rolled back to it
    assert stats.llguidance_requests == 1
    rest = tok.encode('c", "default_branch_name": "', add_special_tokens=False)[3:]
    assert all(state.matcher.accept(t) for t in rest)
    assert state.matcher.forced_bytes() == b""  # main or trunk: the model chooses
