"""A grammar's matcher moved over a text, and the tokens it allows next, for tests that check
a constraint binds (the token that would break it is masked out); ``xgrammar_judge``: whether
the grammar the server compiles for a schema takes whole JSON texts, to compare with
``jsonschema`` on many generated values (no tokenizer needed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from radixserve.structured.backend import Matcher, allocate_bitmask
from radixserve.structured.grammar import GrammarCompiler

# a schema only the second grammar backend enforces exactly: xgrammar drops maxLength beside
# a format and beside a pattern, llguidance keeps both
LLGUIDANCE_ONLY = {
    "type": "object",
    "properties": {
        "contact_email_address": {"type": "string", "format": "email", "maxLength": 30},
        "repository_name": {"type": "string", "pattern": "^[a-z][a-z0-9-]*$", "maxLength": 16},
        "delete_branch_on_merge": {"type": "boolean"},
    },
    "required": ["contact_email_address", "repository_name", "delete_branch_on_merge"],
    "additionalProperties": False,
}


def matcher_after(compiler: GrammarCompiler, hf_tokenizer: Any, schema: Any,
                  text: str) -> Matcher:  # fmt: skip
    """A matcher of ``schema``'s grammar moved over ``text``'s tokens (each must be taken)."""
    m = compiler.start("json_schema", json.dumps(schema)).matcher
    for t in hf_tokenizer.encode(text, add_special_tokens=False):
        assert m.accept(t), (text, hf_tokenizer.decode([t]))
    return m


def allowed(m: Matcher, vocab_size: int) -> torch.Tensor:
    """Which tokens the matcher allows next, as a bool per token id."""
    mask = allocate_bitmask(1, vocab_size)
    m.fill(mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1).bool()[:vocab_size]


def xgrammar_judge(schema: Any) -> Callable[[Any], bool]:
    """Whether the grammar the server compiles for ``schema`` with xgrammar (its exact
    rewrites applied; ``UnsupportedSchema`` where it would refuse the schema) takes the JSON
    text of a value, written as the server writes JSON (", " and ": ")."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from radixserve.structured.xgrammar_backend import XGrammarBackend

    prepared = XGrammarBackend().prepare("json_schema", json.dumps(schema)).text
    grammar = xgr.Grammar.from_json_schema(prepared, any_whitespace=False, strict_mode=True)
    return lambda value: _is_grammar_accept_string(grammar, json.dumps(value))


def generate_and_validate(engine: Any, schemas: dict[str, Any], params: Any) -> dict[str, str]:
    """Runs one constrained request per ``schemas`` entry (id -> schema) on ``engine`` until
    all finish, ``params(request_id)`` giving each its sampling parameters; every output that
    stopped on its own must parse and validate against its schema. Returns each request's
    finish reason."""
    import jsonschema

    outs: dict[str, list[int]] = {rid: [] for rid in schemas}
    reasons: dict[str, str] = {}
    for rid, schema in schemas.items():
        engine.add_request(
            rid, [1, 2, 3, 4], params(rid), grammar=("json_schema", json.dumps(schema))
        )
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    for rid, why in reasons.items():
        if why == "stop":
            jsonschema.validate(json.loads(engine.tokenizer.decode(outs[rid])), schemas[rid])
    return reasons
