"""Constrained decoding: grammars compiled off the step loop, applied as token bitmasks.

A request may carry a grammar (``RequestSpec.grammar``: a ``(kind, text)`` pair, kinds in
``GRAMMAR_KINDS``). The grammar engine is xgrammar (chosen by measurement: about 0.005 ms
per row to fill a mask over SmolLM2's 49K vocabulary, two orders of magnitude under the
alternative; see docs/structured-output.md).

- ``check_grammar(kind, text)`` parses a grammar without a tokenizer (well under a
  millisecond): the HTTP edge calls it so an invalid schema, regex or EBNF is a 400 naming
  the problem before anything is queued; so is a schema or regex using a construct the
  grammar would compile only approximately (``schema_support``). A JSON Schema is compiled
  as ``schema_rewrite`` rewrites it (an equivalent the grammar enforces exactly in more
  cases; ``compiled_schema``), and that is what the check judges.
- ``GrammarCompiler`` compiles against the model's vocabulary on its own worker thread and
  keeps the last ``cache_size`` compiled grammars, keyed by ``(kind, text)``; ``start``
  returns a ``GrammarState`` at once. The scheduler admits a request only once its state is
  ``ready``, so a slow compile holds back that request alone.
- ``GrammarState`` is one request's matcher: ``apply_masks`` sets every token the grammar
  forbids to ``-inf`` in the sampler's logits, ``settle`` advances it with the drawn token.
  A retracted request keeps its output tokens, so its matcher never needs rolling back; it
  is dropped with its request (finish, abort, failure).

Jump forward: where the grammar forces the next characters (a key, a bracket, a fixed
string), ``forced_tokens`` proposes tokens for them (``jump_forward.py``: the model's remembered
spelling of that text, else the tokenizer's encoding) and the request appends them as a
*draft* (``Request.add_draft``), computed in the next step with the token before it, a row
each. ``apply_masks`` fills each row's mask with the matcher moved tentatively over the
draft, and the sampler keeps the draft up to the first token the model would not have drawn
itself, then draws the next token at that row (``settle`` rolls the matcher back over the
rest). So the output is exactly what token-by-token decoding gives, greedy or seeded; a
draft only saves steps where it agrees with the model.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.structured.jump_forward import Drafter, Drafting
from radixserve.structured.regex_support import pattern_problem
from radixserve.structured.schema_rewrite import SchemaRewrite
from radixserve.structured.schema_support import UnsupportedSchema, check_schema_support

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
DEFAULT_CACHE_SIZE = 256
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


def _message(e: Exception) -> str:
    return _LOCATION.sub("", str(e).strip()).strip()


def check_grammar(kind: str, text: str) -> None:
    """``ValueError`` saying what is wrong with a grammar (no tokenizer needed);
    ``UnsupportedSchema`` (a ``ValueError`` with the JSON path) for a schema or regex the
    grammar would not enforce exactly (``schema_support``)."""
    import xgrammar as xgr

    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")
    if not isinstance(text, str):
        raise ValueError(f"the {kind} grammar must be a string")
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
        check_schema_support(schema, compiled_schema(schema))
    elif kind == "regex" and pattern_problem(text):
        raise UnsupportedSchema("", pattern_problem(text) or "")


def compiled_schema(schema: Any) -> SchemaRewrite:
    """What the engine compiles for a JSON Schema (``.result``): ``rewrite_schema``'s
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


def exact_schema_text(text: str) -> str:
    """``compiled_schema`` of a schema's text, as text."""
    return json.dumps(compiled_schema(json.loads(text)).result)


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    constrained_requests: int = 0


class GrammarState:
    """One request's position in its grammar (``ready`` once its grammar is compiled)."""

    def __init__(self, compiled: Future, drafter: Drafter, stats: GrammarStats):
        self._compiled = compiled
        self._drafting, self._stats = Drafting(drafter), stats
        self._matcher: Any = None
        self._draft: list[int] = []  # the draft the masks were filled for
        self._proposed: list[int] = []  # the last forced_tokens answer
        self._tentative = 0  # draft tokens the matcher went over to fill masks

    @property
    def ready(self) -> bool:
        return self._compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self._compiled.exception() if self._compiled.done() else None

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    def fill_rows(self, bitmask: torch.Tensor, first: int, draft: list[int]) -> None:
        """Fill row ``first`` with the mask now, then one row per draft token with the
        matcher moved over the draft (tentatively, until ``settle``); rows after a token the
        grammar refuses stay all-allowed (the sampler never keeps a token past it)."""
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, first)
        self._draft, self._tentative = list(draft), 0
        for t in draft:
            if not m.accept_token(t):
                break
            self._tentative += 1
            m.fill_next_token_bitmask(bitmask, first + self._tentative)

    def settle(self, drafted: int, kept: int, token: int) -> None:
        """``kept`` of ``drafted`` draft tokens were kept, then ``token`` was drawn."""
        if kept > self._tentative:
            raise RuntimeError(f"{kept} draft tokens kept but the grammar took {self._tentative}")
        if self._tentative > kept:
            self.matcher.rollback(self._tentative - kept)
        self._tentative = 0
        draft = self._draft[:drafted]  # its own proposal, or another draft source's
        own = bool(draft) and draft == self._proposed[:drafted]
        self._drafting.settle(draft, kept, token, own)
        self._draft = []
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    def forced_tokens(self, limit: int) -> list[int]:
        """A draft for the text the grammar forces next (at most ``limit`` tokens, maybe
        none; ``drafts.py``)."""
        if self._matcher is None or self._matcher.is_terminated():
            return []
        forced = self._matcher.find_jump_forward_string()
        self._proposed = self._drafting.propose(forced, limit)
        return self._proposed

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class GrammarCompiler:
    """Compiles grammars for one vocabulary on a worker thread, with a bounded cache."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE):  # fmt: skip
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._drafter = Drafter(hf_tokenizer, stop_token_ids, info.decoded_vocab)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()  # stats are written by the worker too
        self.cache_size = cache_size
        self.stats = GrammarStats()

    def start(self, kind: str, text: str) -> GrammarState:
        key = (kind, text)
        self.stats.constrained_requests += 1
        found = self._cache.get(key)
        if found is not None and not (found.done() and found.exception()):
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            return GrammarState(found, self._drafter, self.stats)
        future = self._pool.submit(self._compile, kind, text)
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return GrammarState(future, self._drafter, self.stats)

    def _compile(self, kind: str, text: str) -> Any:
        t0 = time.perf_counter()
        c = self._compiler
        if kind in ("json_object", "json_schema"):
            # compact JSON: no run of free whitespace for a model to wander in
            schema = '{"type": "object"}' if kind == "json_object" else exact_schema_text(text)
            compiled = c.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        elif kind == "regex":
            compiled = c.compile_regex(text)
        else:
            compiled = c.compile_grammar(text)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - t0
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_masks(logits: torch.Tensor, spans: list[tuple[int, GrammarState, list[int]]]) -> None:
    """For each ``(first_row, state, draft)``: set every token the grammar forbids to ``-inf``
    in ``logits[first_row]`` and, with a draft, in the row after each draft token
    (``GrammarState.fill_rows``)."""
    import xgrammar as xgr

    vocab = logits.shape[1]
    rows = [first + i for first, _, draft in spans for i in range(len(draft) + 1)]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    at = 0
    for _, state, draft in spans:
        state.fill_rows(bitmask, at, draft)
        at += len(draft) + 1
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, sub)
