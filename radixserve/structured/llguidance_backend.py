"""The llguidance backend: JSON Schemas xgrammar would not enforce exactly.

llguidance (pinned in pyproject.toml) compiles JSON Schema to a grammar that is either
exact or refused: a keyword it does not implement (``uniqueItems``, ``not``, ``if``,
``contains``, ``propertyNames``, ``dependencies``, ...), a ``oneOf`` it cannot prove
exclusive, a pattern with a lookaround, a ``$ref`` outside the document, ``minProperties``
beside optional properties are errors, not warnings, as long as its ``lenient`` and
``coerce_one_of`` options stay off; they are forced off here, whatever the schema's own
``x-guidance`` asks. What it does approximately is handled before it sees the schema:

- a ``format`` it does not know is an error there; here it is what the JSON Schema
  specification makes it by default, an annotation (xgrammar treats such formats the same
  way), so it is left out;
- its keys matched by ``additionalProperties`` / ``patternProperties`` may repeat (its
  documented departure), so ``minProperties`` that two or more such keys would have to meet
  is refused (a repeated key counts once once parsed); ``schema_support`` refuses the same
  for xgrammar, which behaves alike;
- no-op keywords it would refuse (``uniqueItems: false``, empty ``dependencies``, anchors
  no ``$recursiveRef`` / ``$dynamicRef`` reads) are dropped, and an ``https`` spelling of a
  draft's ``$schema`` (which it would try to fetch) is read as that draft.

It is given the schema as ``schema_rewrite`` rewrites it (exact rewrites: ``not``,
``if``/``then``/``else``, patterns, ... as for xgrammar), without ``uniqueItems``, which a
``UniquePlan`` enforces beside the grammar. A refusal names the construct's path in the schema
as given (``llguidance_refusal``). JSON is written as xgrammar writes it: no free
whitespace, ", " and ": " between items and after keys.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from radixserve.structured.backend import Prepared
from radixserve.structured.llguidance_refusal import Where, refusal
from radixserve.structured.schema_rewrite import SchemaRewrite
from radixserve.structured.schema_support import UnsupportedSchema, repeated_keys_problem
from radixserve.structured.schema_walk import map_schemas, subschemas
from radixserve.structured.unique_plan import UniquePlan, strip_unique

# the formats llguidance 1.9.1 enforces (parser/src/json/formats.rs)
KNOWN_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname",
                           "ipv4", "ipv6", "uuid", "uri", "unknown"})  # fmt: skip
DRAFTS = {f"https://json-schema.org/draft-0{n}/schema": f"http://json-schema.org/draft-0{n}/schema#"
          for n in (4, 6, 7)}  # fmt: skip
# xgrammar's compact separators, so an output reads the same whichever backend wrote it
OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
           "lenient": False, "coerce_one_of": False}  # fmt: skip


def _tidy(s: dict) -> dict:
    """One schema object without what llguidance would refuse but means nothing."""
    out = dict(s)
    if out.get("uniqueItems") is False:
        del out["uniqueItems"]
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        if out.get(key) == {}:
            del out[key]
    if isinstance(out.get("format"), str) and out["format"] not in KNOWN_FORMATS:
        del out["format"]
    return out


def prepared_schema(schema: Any) -> Any:
    """The schema as llguidance is given it (see the module's docstring)."""
    if not isinstance(schema, dict):
        return schema
    out = map_schemas(schema, _tidy)
    text = json.dumps(schema)
    for anchor, ref in (("$recursiveAnchor", "$recursiveRef"), ("$dynamicAnchor", "$dynamicRef")):
        if f'"{ref}"' not in text:
            out = map_schemas(out, lambda s, a=anchor: {k: v for k, v in s.items() if k != a})
    draft = out.get("$schema")
    if isinstance(draft, str) and draft.rstrip("#") in DRAFTS:
        out["$schema"] = DRAFTS[draft.rstrip("#")]
    out.pop("x-guidance", None)
    return out


class LLGuidanceBackend:
    name = "llguidance"

    def prepare(self, kind: str, text: str) -> Prepared:
        import llguidance as llg

        if kind != "json_schema":
            raise ValueError(f"the llguidance backend takes JSON Schemas, not {kind}")
        schema = json.loads(text)
        rewrite = SchemaRewrite(schema)
        given = prepared_schema(rewrite.result)
        where = Where(given, rewrite)
        plan = UniquePlan.of(given, where.locate)
        for node, _ in subschemas(given):
            problem = repeated_keys_problem(node)
            if problem:
                raise UnsupportedSchema(where.path(node, "minProperties"), problem)
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(strip_unique(given),
                                                             overrides=OPTIONS)  # fmt: skip
        except ValueError as e:
            raise ValueError(f"invalid json schema: {e}") from e
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
        if failed or messages:  # a warning means something was not enforced: refused too
            raise refusal(where, messages[0] if messages else "refused")
        return Prepared(grammar, plan)

    def vocabulary(self, hf_tokenizer: Any, vocab_size: int,
                   stop_token_ids: list[int]) -> LLGuidanceVocabulary:  # fmt: skip
        return LLGuidanceVocabulary(hf_tokenizer, vocab_size, stop_token_ids)


class LLGuidanceVocabulary:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import llguidance.hf

        self._stops = frozenset(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )

    def compile(self, kind: str, prepared: str) -> Any:
        """A fresh matcher, copied for each request (``LLMatcher.deep_copy``)."""
        import llguidance as llg

        matcher = llg.LLMatcher(self._tokenizer, prepared, log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance refused the grammar: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled: Any) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self._stops)


class LLGuidanceMatcher:
    def __init__(self, matcher: Any, stops: frozenset[int]):
        self._m, self._stops = matcher, stops
        self._ended = False  # an end token was accepted (xgrammar's "terminated" too)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, token: int) -> bool:
        if self._m.is_stopped():  # complete: its try/validate calls refuse even the end here
            self._ended = token in self._stops and self._m.consume_token(token)
            return self._ended
        if self._m.try_consume_tokens([token]) != 1:
            return False
        self._ended = token in self._stops
        return True

    def rollback(self, count: int) -> None:
        self._m.rollback(count)

    def forced_bytes(self) -> bytes:
        return self._m.compute_ff_bytes()

    @property
    def terminated(self) -> bool:
        return self._ended
