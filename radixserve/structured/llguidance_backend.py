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

A refusal names the construct's path in the schema, found from llguidance's message
(``_refusal``). JSON is written as xgrammar writes it: no free whitespace, ", " and ": "
between items and after keys.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from radixserve.structured.regex_support import pattern_problem
from radixserve.structured.schema_support import UnsupportedSchema, repeated_keys_problem
from radixserve.structured.schema_walk import find_keyword, map_schemas, subschemas

# the formats llguidance 1.9.1 enforces (parser/src/json/formats.rs)
KNOWN_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname",
                           "ipv4", "ipv6", "uuid", "uri", "unknown"})  # fmt: skip
DRAFTS = {f"https://json-schema.org/draft-0{n}/schema": f"http://json-schema.org/draft-0{n}/schema#"
          for n in (4, 6, 7)}  # fmt: skip
# xgrammar's compact separators, so an output reads the same whichever backend wrote it
OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
           "lenient": False, "coerce_one_of": False}  # fmt: skip
_KEYS = re.compile(r"Unimplemented keys: \[(.*)\]")


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

    def prepare(self, kind: str, text: str) -> str:
        import llguidance as llg

        if kind != "json_schema":
            raise ValueError(f"the llguidance backend takes JSON Schemas, not {kind}")
        schema = json.loads(text)
        given = prepared_schema(schema)
        for node, path in subschemas(given):
            problem = repeated_keys_problem(node)
            if problem:
                raise UnsupportedSchema(f"{path}.minProperties" if path else "minProperties",
                                        problem)  # fmt: skip
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(given, overrides=OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid json schema: {e}") from e
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
        if failed or messages:  # a warning means something was not enforced: refused too
            raise _refusal(given, messages[0] if messages else "refused")
        return grammar

    def vocabulary(self, hf_tokenizer: Any, vocab_size: int,
                   stop_token_ids: list[int]) -> LLGuidanceVocabulary:  # fmt: skip
        return LLGuidanceVocabulary(hf_tokenizer, vocab_size, stop_token_ids)


def _refusal(schema: Any, message: str) -> UnsupportedSchema:
    """``UnsupportedSchema`` at the construct llguidance's ``message`` is about."""
    first = message.strip().splitlines()[0]
    keys = _KEYS.search(first)
    if keys:
        names = json.loads(f"[{keys.group(1)}]")
        path = find_keyword(schema, lambda s: next((k for k in names if k in s), None))
        key = (path or names[0]).rsplit(".", 1)[-1]
        return UnsupportedSchema(path or "", f"{key} is not supported")
    if first.startswith("regex parse error"):
        return _pattern_refusal(schema, message)
    if first.startswith("oneOf constraints"):
        path = find_keyword(schema, lambda s: "oneOf" if "oneOf" in s else None)
        return UnsupportedSchema(path or "", "oneOf whose branches may overlap is not "
                                 "supported (an output could match two)")  # fmt: skip
    if first.startswith("min/maxProperties"):
        path = find_keyword(schema, _min_max)
        return UnsupportedSchema(path or "", "minProperties/maxProperties beside properties "
                                 "that are not all required is not supported")  # fmt: skip
    if first.startswith("Resource '"):
        target = first.split("'")[1]
        path = find_keyword(schema, lambda s: "$ref" if _refers(s, target) else None)
        return UnsupportedSchema(path or "", f"a $ref to {target}, outside the schema, is not "
                                 "supported")  # fmt: skip
    if first.startswith("circular references with sibling keys"):
        pointer = first.rsplit("#", 1)[-1].strip("/")  # the definition referred to
        path = find_keyword(schema, lambda s: "$ref" if _points_to(s, pointer) else None)
        return UnsupportedSchema(path or "", "a $ref with keywords beside it, in a cycle of "
                                 f"references to #/{pointer}, is not supported")  # fmt: skip
    return UnsupportedSchema("", first)


def _points_to(s: dict, pointer: str) -> bool:
    ref = s.get("$ref")
    beside = set(s) - {"$ref", "$defs", "definitions", "$schema", "$id", "id", "$comment",
                       "title", "description", "default", "examples"}  # fmt: skip
    return isinstance(ref, str) and ref.split("#")[-1].strip("/") == pointer and bool(beside)


def _pattern_refusal(schema: Any, message: str) -> UnsupportedSchema:
    """At the pattern llguidance quotes (it may have rewritten ``\\d`` and ``\\w``), else at
    the first pattern with a construct ``pattern_problem`` names."""
    lines = message.strip().splitlines()
    quoted = lines[1].strip() if len(lines) > 1 else ""
    found = []
    for node, path in subschemas(schema):
        where = path + "." if path else ""
        if isinstance(node.get("pattern"), str):
            found.append((where + "pattern", node["pattern"]))
        if isinstance(node.get("patternProperties"), dict):
            found += [(where + "patternProperties." + p, p) for p in node["patternProperties"]]
    for path, pattern in found:
        if pattern == quoted or pattern_problem(pattern):
            return UnsupportedSchema(path, pattern_problem(pattern) or lines[-1].strip())
    return UnsupportedSchema("", pattern_problem(quoted) or lines[-1].strip())


def _min_max(s: dict) -> str | None:
    return next((k for k in ("minProperties", "maxProperties") if k in s), None)


def _refers(s: dict, target: str) -> bool:
    ref = s.get("$ref")
    return isinstance(ref, str) and bool(ref.split("#")[0]) and target.endswith(ref.split("#")[0])


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
