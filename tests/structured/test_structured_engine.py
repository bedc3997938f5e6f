"""Constrained decoding in the engine: grammar masks, logit bias, compiles off the step loop."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from radixserve.engine import SamplingParams
from radixserve.structured.grammar import GrammarCompiler, check_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["colour", "count", "ok"],
    "additionalProperties": False,
}


def run(engine, specs):
    outs: dict[str, list[int]] = {}
    reasons = {}
    for rid, params, grammar in specs:
        engine.add_request(rid, [1, 2, 3, 4], params, grammar=grammar)
        outs[rid] = []
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    text = {rid: engine.tokenizer.decode(ids) for rid, ids in outs.items()}
    return text, reasons


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammars_constrain_greedy_and_random_outputs(make_engine, temperature):
    engine = make_engine()
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=3)
    text, reasons = run(
        engine,
        [
            ("schema", params, ("json_schema", json.dumps(SCHEMA))),
            ("regex", params, ("regex", r"[0-9]{3}-[a-z]{2}")),
            ("ebnf", params, ("ebnf", 'root ::= "yes" | "no"')),
            ("free", SamplingParams(max_tokens=8, temperature=0), None),
        ],
    )
    assert reasons["schema"] == reasons["regex"] == reasons["ebnf"] == "stop"  # end of grammar
    jsonschema.validate(json.loads(text["schema"]), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text["regex"])
    assert text["ebnf"] in ("yes", "no")
    assert reasons["free"] == "length"
    assert engine.grammar_stats().constrained_requests == 3


def test_logit_bias_forces_and_bans_tokens(make_engine):
    engine = make_engine()
    free, _ = run(engine, [("a", SamplingParams(max_tokens=4, temperature=0), None)])
    forced = SamplingParams(max_tokens=4, temperature=0, logit_bias={77: 100.0})
    text, _ = run(engine, [("b", forced, None)])
    assert text["b"] == engine.tokenizer.decode([77] * 4) != free["a"]
    first = engine.tokenizer.encode(free["a"], add_special_tokens=False)[0]
    banned = SamplingParams(max_tokens=4, temperature=0, logit_bias={first: -100.0})
    text, _ = run(engine, [("c", banned, None)])
    assert engine.tokenizer.encode(text["c"], add_special_tokens=False)[0] != first
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("d", [1, 2], SamplingParams(logit_bias={10**7: 1.0}))


def test_grammar_cache_hits_and_invalid_grammars():
    for kind, text, words in [
        ("json_schema", '{"type": "objekt"}', "objekt"),
        ("json_schema", "{not json", "not valid JSON"),
        ("regex", "[a-", "regex"),
        ("ebnf", "root ::= missing", "missing"),
        ("yaml", "", "unknown grammar kind"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_grammar(kind, text)


def test_a_slow_grammar_compile_holds_back_only_its_request(make_engine, monkeypatch):
    engine = make_engine()
    release = threading.Event()
    real = GrammarCompiler._compile

    def slow(self, kind, text):
        release.wait(60)
        return real(self, kind, text)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    engine.add_request("slow", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0),
                       grammar=("regex", "[ab]{4}"))  # fmt: skip
    engine.add_request("free", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    finished = set()
    for _ in range(20):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"free"}  # it ran to the end while the other's grammar compiled
    release.set()
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"free", "slow"}
    stats = engine.grammar_stats()
    engine.add_request("again", [1, 2], SamplingParams(max_tokens=4), grammar=("regex", "[ab]{4}"))
    assert engine.grammar_stats().cache_hits == stats.cache_hits + 1
    engine.abort_request("again")
