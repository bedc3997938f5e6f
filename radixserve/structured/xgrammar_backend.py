"""The xgrammar backend: the first choice, for every kind of grammar.

xgrammar (pinned in pyproject.toml) fills a mask over SmolLM2's 49K vocabulary in about a
microsecond at the median, about 15x faster than llguidance (docs/structured-output.md), so
a grammar goes to it whenever it enforces the whole grammar. ``prepare`` decides that: a JSON Schema
is compiled as ``schema_rewrite`` rewrites it (an equivalent xgrammar enforces exactly in
more cases; ``compiled_schema``), and ``schema_support`` refuses the rewritten schema if
xgrammar would still drop or approximate a construct of it; a regex gets the same pattern
check. Compiled JSON is compact (no free whitespace for a model to wander in).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from radixserve.structured.regex_support import pattern_problem
from radixserve.structured.schema_rewrite import SchemaRewrite
from radixserve.structured.schema_support import UnsupportedSchema, check_schema_support

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
            xgr.Grammar.from_json_schema(text)
            return rewrite
        except Exception:
            pass
    return SchemaRewrite(schema, enabled=False)


class XGrammarBackend:
    name = "xgrammar"

    def prepare(self, kind: str, text: str) -> str:
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
            check_schema_support(schema, rewrite)
            return json.dumps(rewrite.result)
        if kind == "regex" and pattern_problem(text):
            raise UnsupportedSchema("", pattern_problem(text) or "")
        return ANY_OBJECT if kind == "json_object" else text

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
