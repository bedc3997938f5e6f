"""Constrained decoding: grammars compiled off the step loop, applied as token bitmasks.

A request may carry a grammar (``RequestSpec.grammar``: a ``(kind, text)`` pair, kinds in
``GRAMMAR_KINDS``). Two grammar engines stand behind ``backend.Backend``: xgrammar
(``xgrammar_backend``, every kind, masks about 15x cheaper) and llguidance
(``llguidance_backend``, JSON Schemas only). ``choose_backend`` picks, deterministically
from the grammar alone: xgrammar where it enforces the whole grammar, else llguidance where
it does, else ``UnsupportedSchema`` naming the construct (never an unconstrained request).

- ``check_grammar(kind, text)`` makes that choice without a tokenizer (a few milliseconds):
  the HTTP edge calls it so an invalid grammar, or one neither engine enforces exactly, is a
  400 naming the problem before anything is queued.
- ``GrammarCompiler`` makes the same choice again and compiles against the model's
  vocabulary on its own worker thread, keeping the last ``cache_size`` compiled grammars,
  keyed by ``(kind, text)``; ``start`` returns a ``GrammarState`` at once. The scheduler
  admits a request only once its state is ``ready``, so a slow compile holds back that
  request alone. ``GrammarStats`` counts requests by the backend that enforced them.
- ``GrammarState`` is one request's matcher: ``apply_masks`` sets every token the grammar
  forbids to ``-inf`` in the sampler's logits, ``settle`` advances it with the drawn token.
  A retracted request keeps its output tokens, so its matcher never needs rolling back; it
  is dropped with its request (finish, abort, failure).

Jump forward: where the grammar forces the next characters (a key, a bracket, a fixed
string), ``forced_tokens(limit)`` proposes tokens for them (``jump_forward.py``: the model's
remembered spelling of that text, else the tokenizer's encoding) and the request appends
them as a *draft* (``Request.add_draft``), computed in the next step with the token before
it, a row each. ``apply_masks`` fills each row's mask with the matcher moved tentatively
over the draft, and the sampler keeps the draft up to the first token the model would not
have drawn itself, then draws the next token at that row; ``settle(drafted, kept, token)``
rolls the matcher back over the rest. So the output is exactly what token-by-token decoding
gives, greedy or seeded; a draft only saves steps where it agrees with the model. Both
calls are the same for either backend.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.structured.backend import (
    Backend,
    Matcher,
    Prepared,
    Vocabulary,
    allocate_bitmask,
)
from radixserve.structured.jump_forward import Drafter, Drafting
from radixserve.structured.llguidance_backend import LLGuidanceBackend
from radixserve.structured.schema_support import UnsupportedSchema
from radixserve.structured.unique_matcher import UniqueMatcher
from radixserve.structured.unique_tokens import TokenClasses
from radixserve.structured.xgrammar_backend import XGrammarBackend

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
DEFAULT_CACHE_SIZE = 256
XGRAMMAR, LLGUIDANCE = XGrammarBackend(), LLGuidanceBackend()
BACKENDS: tuple[Backend, ...] = (XGRAMMAR, LLGUIDANCE)  # in the order they are tried


def choose_backend(kind: str, text: str) -> tuple[Backend, Prepared]:
    """The backend that enforces ``(kind, text)`` exactly and what it compiles for it.
    ``ValueError`` for an invalid grammar; ``UnsupportedSchema`` (a ``ValueError`` with the
    JSON path) where neither backend enforces it, naming what llguidance refused (xgrammar
    refused something too, maybe another construct)."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")
    if not isinstance(text, str):
        raise ValueError(f"the {kind} grammar must be a string")
    try:
        return XGRAMMAR, XGRAMMAR.prepare(kind, text)
    except UnsupportedSchema as e:
        if kind != "json_schema":
            raise
        first: ValueError = e
    except ValueError as e:
        if kind != "json_schema" or isinstance(e.__cause__, json.JSONDecodeError):
            raise
        first = e
    try:
        return LLGUIDANCE, LLGUIDANCE.prepare(kind, text)
    except UnsupportedSchema as e:
        if isinstance(first, UnsupportedSchema):
            raise e from first
        raise first from e  # invalid for xgrammar, and llguidance did not take it either
    except ValueError:
        raise first from None


def check_grammar(kind: str, text: str) -> None:
    """``ValueError`` saying what is wrong with a grammar (no tokenizer needed);
    ``UnsupportedSchema`` (a ``ValueError`` with the JSON path) for a schema or regex no
    backend would enforce exactly (``choose_backend``)."""
    choose_backend(kind, text)


def grammar_backend(kind: str, text: str) -> str:
    """The name of the backend that enforces the grammar (``check_grammar``'s choice)."""
    return choose_backend(kind, text)[0].name


@dataclass(frozen=True)
class Compiled:
    """A grammar compiled for one vocabulary by ``backend``; where its schema asks for
    distinct items, their plan (``unique``) and the vocabulary's ``TokenClasses``."""

    backend: str
    grammar: Any
    vocabulary: Vocabulary
    unique: Any = None
    tokens: TokenClasses | None = None
    stops: frozenset[int] = frozenset()

    def matcher(self) -> Matcher:
        inner = self.vocabulary.matcher(self.grammar)
        if self.unique is None or self.tokens is None:
            return inner
        return UniqueMatcher(inner, self.unique, self.tokens, self.stops)


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    constrained_requests: int = 0
    # constrained requests by the backend that enforced their grammar (``choose_backend``)
    xgrammar_requests: int = 0
    llguidance_requests: int = 0

    def count_backend(self, name: str) -> None:
        setattr(self, f"{name}_requests", getattr(self, f"{name}_requests") + 1)


class GrammarState:
    """One request's position in its grammar (``ready`` once its grammar is compiled)."""

    def __init__(self, compiled: Future, drafter: Drafter, stats: GrammarStats):
        self._compiled = compiled  # of a Compiled
        self._drafting, self._stats = Drafting(drafter), stats
        self._matcher: Matcher | None = None
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
    def backend(self) -> str:
        """The name of the backend enforcing the grammar (once ``ready``)."""
        return self._compiled.result().backend

    @property
    def matcher(self) -> Matcher:
        if self._matcher is None:
            compiled: Compiled = self._compiled.result()
            self._matcher = compiled.matcher()
            self._stats.count_backend(compiled.backend)
        return self._matcher

    def fill_rows(self, bitmask: torch.Tensor, first: int, draft: list[int]) -> None:
        """Fill row ``first`` with the mask now, then one row per draft token with the
        matcher moved over the draft (tentatively, until ``settle``); rows after a token the
        grammar refuses stay all-allowed (the sampler never keeps a token past it)."""
        m = self.matcher
        m.fill(bitmask, first)
        self._draft, self._tentative = list(draft), 0
        for t in draft:
            if not m.accept(t):
                break
            self._tentative += 1
            m.fill(bitmask, first + self._tentative)

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
        if not self.matcher.accept(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    def forced_tokens(self, limit: int) -> list[int]:
        """A draft for the text the grammar forces next (at most ``limit`` tokens, maybe
        none; ``jump_forward.py``)."""
        if self._matcher is None or self._matcher.terminated:
            return []
        forced = self._matcher.forced_bytes().decode("utf-8", errors="ignore")
        self._proposed = self._drafting.propose(forced, limit)
        return self._proposed

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.terminated


class GrammarCompiler:
    """Compiles grammars for one vocabulary on a worker thread, with a bounded cache. Each
    backend's vocabulary is built on first use (xgrammar's at once: its token texts feed the
    drafts)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE):  # fmt: skip
        self._tokenizer = (hf_tokenizer, vocab_size, list(stop_token_ids))
        xgr_vocab = XGRAMMAR.vocabulary(*self._tokenizer)
        self._vocabularies: dict[str, Vocabulary] = {XGRAMMAR.name: xgr_vocab}
        self._drafter = Drafter(hf_tokenizer, stop_token_ids, xgr_vocab.token_bytes)
        self._tokens: TokenClasses | None = None  # built when a schema first asks for it
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

    def _compile(self, kind: str, text: str) -> Compiled:
        t0 = time.perf_counter()
        backend, prepared = choose_backend(kind, text)
        vocabulary = self._vocabularies.get(backend.name)
        if vocabulary is None:  # only the worker thread builds and reads these
            vocabulary = self._vocabularies[backend.name] = backend.vocabulary(*self._tokenizer)
        if prepared.unique is not None and self._tokens is None:
            self._tokens = TokenClasses(self._drafter.token_bytes, self._tokenizer[1])
        grammar = vocabulary.compile(kind, prepared.text)
        compiled = Compiled(backend.name, grammar, vocabulary, prepared.unique, self._tokens,
                            frozenset(self._tokenizer[2]))  # fmt: skip
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
    vocab = logits.shape[1]
    rows = [first + i for first, _, draft in spans for i in range(len(draft) + 1)]
    bitmask = allocate_bitmask(len(rows), vocab)
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
