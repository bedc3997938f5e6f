"""The xgrammar backend: the first choice, for every kind of grammar.

xgrammar (pinned in pyproject.toml) fills a mask over SmolLM2's 49K vocabulary in about a
microsecond at the median, about 15x faster than llguidance (docs/structured-output.md), so
a grammar goes to it whenever it enforces the whole grammar. ``prepare`` decides that: a JSON Schema
is compiled as ``schema_rewrite`` rewrites it (an equivalent xgrammar enforces exactly in
more cases; ``compiled_schema``), and ``schema_support`` refuses the rewritten schema if
xgrammar would still drop or approximate a construct of it; a regex gets the same pattern
check. Distinct items (``uniqueItems``) are left to a ``UniquePlan`` beside the grammar
(``unique_matcher``), and a property a branch closes out (``"k": false``) is left out of
``properties`` where xgrammar's strict mode allows no other key, and a pattern's ``(...)?``
is written ``(...){0,1}``, which xgrammar reads right (``xgrammar_text``).
Compiled JSON is compact (no free whitespace for a model to wander in).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from radixserve.structured.backend import Prepared
from radixserve.structured.regex_support import optional_groups_spelled_out, pattern_problem
from radixserve.structured.schema_rewrite import SchemaRewrite
from radixserve.structured.schema_support import UnsupportedSchema, check_schema_support
from radixserve.structured.schema_walk import map_schemas
from radixserve.structured.unique_plan import UniquePlan, strip_unique

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix
ANY_OBJECT = '{"type": "object"}'


def _message(e: Exception) -> str:
    return _LOCATION.sub("", str(e).strip()).strip()


def compiled_schema(schema: Any) -> SchemaRewrite:
    """What xgrammar compiles for a JSON Schema (``.result``): ``rewrite_schema``'s
    equivalent (``schema_rewrite``), or the schema as written where the rewrite changes
    nothing or xgrammar cannot compile it (a construct it rejects, such as an array of
    ``items``, that the original held only where it was compiled as any value). The support
    check judges the one compiled."""
    import xgrammar as xgr

    rewrite = SchemaRewrite(schema)
    text = json.dumps(rewrite.result)
    if rewrite.result is not schema and text != json.dumps(schema):
        try:
            xgr.Grammar.from_json_schema(xgrammar_text(rewrite.result))
            return rewrite
        except Exception:
            pass
    return SchemaRewrite(schema, enabled=False)


def _absent(s: dict) -> dict:
    """``s`` without ``"k": false`` in its properties where no other key may be written."""
    props = s.get("properties")
    closed = s.get("additionalProperties", False) is False and not s.get("patternProperties")
    if not (closed and isinstance(props, dict) and False in props.values()):
        return s
    required = s.get("required") if isinstance(s.get("required"), list) else []
    if any(props.get(k) is False for k in required):
        return s  # no value meets it: left for xgrammar to refuse
    return {**s, "properties": {k: v for k, v in props.items() if v is not False}}


def _spelled(s: dict) -> dict:
    """``s`` with its patterns' optional groups spelled ``{0,1}`` (``regex_support``)."""
    out = dict(s)
    if isinstance(s.get("pattern"), str):
        out["pattern"] = optional_groups_spelled_out(s["pattern"])
    if isinstance(s.get("patternProperties"), dict):
        out["patternProperties"] = {optional_groups_spelled_out(k): v
                                    for k, v in s["patternProperties"].items()}  # fmt: skip
    return out


def xgrammar_text(schema: Any) -> str:
    """The text xgrammar compiles for a (rewritten) schema: distinct items left to the
    tracker, absent keys left out where its strict mode writes no other key, optional
    groups of patterns spelled the way it reads right."""
    return json.dumps(map_schemas(strip_unique(schema), lambda s: _spelled(_absent(s))))


class XGrammarBackend:
    name = "xgrammar"

    def prepare(self, kind: str, text: str) -> Prepared:
        import xgrammar as xgr

        try:
            if kind == "json_schema":
                schema = json.loads(text)
                xgr.Grammar.from_json_schema(text)
            elif kind == "regex":
                xgr.Grammar.from_regex(text)
            elif kind == "ebnf":
                xgr.Grammar.from_ebnf(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
        except Exception as e:
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {_message(e)}") from e
        if kind == "json_schema":
            rewrite = compiled_schema(schema)
            plan = UniquePlan.of(rewrite.result, rewrite.locate)
            check_schema_support(schema, rewrite, unique=plan is not None)
            return Prepared(xgrammar_text(rewrite.result), plan)
        if kind == "regex" and pattern_problem(text):
            raise UnsupportedSchema("", pattern_problem(text) or "")
        return Prepared(ANY_OBJECT if kind == "json_object" else text)

    def vocabulary(self, hf_tokenizer: Any, vocab_size: int,
                   stop_token_ids: list[int]) -> XGrammarVocabulary:  # fmt: skip
        return XGrammarVocabulary(hf_tokenizer, vocab_size, stop_token_ids)


class XGrammarVocabulary:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.token_bytes: list[bytes] = info.decoded_vocab  # each token id's text as bytes

    def compile(self, kind: str, prepared: str) -> Any:
        if kind in ("json_object", "json_schema"):
            return self._compiler.compile_json_schema(
                prepared, any_whitespace=False, strict_mode=True
            )
        if kind == "regex":
            return self._compiler.compile_regex(prepared)
        return self._compiler.compile_grammar(prepared)

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)


class XGrammarMatcher:
    def __init__(self, compiled: Any):
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, count: int) -> None:
        self._m.rollback(count)

    def forced_bytes(self) -> bytes:
        return self._m.find_jump_forward_string().encode()

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()
