"""Constrained decoding: grammars compiled off the step loop, applied as token bitmasks.

A request may carry a grammar (``RequestSpec.grammar``: a ``(kind, text)`` pair, kinds in
``GRAMMAR_KINDS``). The grammar engine is xgrammar (chosen by measurement: about 0.005 ms
per row to fill a mask over SmolLM2's 49K vocabulary, two orders of magnitude under the
alternative; see docs/structured-output.md).

- ``check_grammar(kind, text)`` parses a grammar without a tokenizer (well under a
  millisecond): the HTTP edge calls it so an invalid schema, regex or EBNF is a 400 naming
  the problem before anything is queued.
- ``GrammarCompiler`` compiles against the model's vocabulary on its own worker thread and
  keeps the last ``cache_size`` compiled grammars, keyed by ``(kind, text)``; ``start``
  returns a ``GrammarState`` at once. The scheduler admits a request only once its state is
  ``ready``, so a slow compile holds back that request alone.
- ``GrammarState`` is one request's matcher: ``apply_masks`` sets every token the grammar
  forbids to ``-inf`` in the sampler's logits, ``accept`` advances it with the drawn token.
  A retracted request keeps its output tokens, so its matcher never needs rolling back; it
  is dropped with its request (finish, abort, failure).
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

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
DEFAULT_CACHE_SIZE = 256
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


def _message(e: Exception) -> str:
    return _LOCATION.sub("", str(e).strip()).strip()


def check_grammar(kind: str, text: str) -> None:
    """``ValueError`` saying what is wrong with a grammar (no tokenizer needed)."""
    import xgrammar as xgr

    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")
    if not isinstance(text, str):
        raise ValueError(f"the {kind} grammar must be a string")
    try:
        if kind == "json_schema":
            json.loads(text)
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    except Exception as e:
        raise ValueError(f"invalid {kind.replace('_', ' ')}: {_message(e)}") from e


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    constrained_requests: int = 0


class GrammarState:
    """One request's position in its grammar (``ready`` once its grammar is compiled)."""

    def __init__(self, compiled: Future):
        self._compiled = compiled
        self._matcher: Any = None

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

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

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
            return GrammarState(found)
        future = self._pool.submit(self._compile, kind, text)
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return GrammarState(future)

    def _compile(self, kind: str, text: str) -> Any:
        t0 = time.perf_counter()
        c = self._compiler
        if kind in ("json_object", "json_schema"):
            # compact JSON: no run of free whitespace for a model to wander in
            schema = '{"type": "object"}' if kind == "json_object" else text
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


def apply_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set every token the grammar of ``states[j]`` forbids to ``-inf`` in ``logits[rows[j]]``."""
    import xgrammar as xgr

    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for j, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(bitmask, j)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, sub)
