"""Distinct items (``uniqueItems``) enforced beside the grammar: a matcher that also bans the
tokens that would repeat an item.

``UniqueMatcher(inner, plan, tokens)`` is a ``backend.Matcher``: it fills a row with the
grammar's mask, then clears the bits of the tokens the ``Tracker`` says would break the
``ItemRule`` of the array being written; it feeds every token it accepts to the tracker and
keeps the tracker's state before each, so ``rollback`` (a draft the model did not keep)
restores it exactly. Drafts, forced text and the end of the grammar are the inner
matcher's.

Trying every token of the vocabulary on the tracker would cost milliseconds a step, so only
candidates are tried, those that can break the rule (``TokenClasses``, built once per
vocabulary), and only inside an array whose items must be distinct:

- inside a string that is an item, the tokens that close it on the rest of an earlier item
  (one look-up) are banned without a try; tried are those that go on to write another item
  (three quotes for strings, a quote then a value for any values) or hold an escape;
- inside a record's string, the tokens that close it on an earlier record's value, and those
  with two quotes; inside a string deeper in an item, those with a quote and more after it;
- elsewhere, the tokens the grammar allows that hold two quotes (for strings), or also a
  ``,``, ``]`` or ``}`` or a literal's first letter;
- for listed values, every token the grammar allows (few there).
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.structured.backend import Matcher
from radixserve.structured.unique_plan import UniquePlan
from radixserve.structured.unique_tokens import TokenClasses, token_ids
from radixserve.structured.unique_tracker import Tracker

HISTORY = 512  # states kept for rollback (drafts are far shorter)


class UniqueMatcher:
    """A grammar's matcher with the tokens that would repeat an item banned."""

    def __init__(self, inner: Matcher, plan: UniquePlan, tokens: TokenClasses,
                 stops: frozenset[int]):  # fmt: skip
        self._m, self._tokens, self._stops = inner, tokens, stops
        self._tracker = Tracker(plan)
        self._history: list[tuple] = []

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill(bitmask, row)
        if not self._tracker.at_risk:
            return
        words = bitmask[row].numpy().view(np.uint32)
        sure, tried = self._candidates(words)
        banned = sure + [t for t in tried if self._breaks(t)]
        for t in banned:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        if banned and not words.any():
            raise RuntimeError("uniqueItems: every token the grammar allows repeats an item")

    def _candidates(self, words: np.ndarray) -> tuple[list[int], list[int]]:
        """Tokens to ban without a try, and tokens to try (see the module docstring)."""
        tracker, tokens = self._tracker, self._tokens
        size, rule = len(tokens.bytes), tracker.rule
        if rule is None:
            return [], []
        if rule.kind == "listed":
            return [], token_ids(words, size)
        if not tracker.in_string:
            return [], token_ids(words & (tokens.two_quotes if rule.strings_only
                                          else tokens.structure), size)  # fmt: skip
        if tracker.escaped:
            return [], token_ids(words & tokens.quote, size)
        rests, sure = tracker.remainders()
        hits = [t for rest in rests for t in tokens.closes.get(rest, ())]
        if tracker.in_item_string():
            more = tokens.three_quotes if rule.strings_only else tokens.quote_value
        else:
            more = tokens.two_quotes if rule.kind == "record" else tokens.quote_more
        tried = token_ids(words & (more | tokens.escaped), size)
        return (hits, tried) if sure else ([], tried + hits)

    def _breaks(self, token: int) -> bool:
        tracker = self._tracker
        snap = tracker.snapshot()
        broken = not tracker.feed(self._tokens.bytes[token])
        tracker.restore(snap)
        return broken

    def accept(self, token: int) -> bool:
        if not self._m.accept(token):
            return False
        self._history.append(self._tracker.snapshot())
        if len(self._history) > HISTORY:
            del self._history[: HISTORY // 2]
        if token not in self._stops and not self._tracker.feed(self._tokens.bytes[token]):
            self._tracker.restore(self._history.pop())
            self._m.rollback(1)
            return False  # the mask banned it: only a caller ignoring the mask gets here
        return True

    def rollback(self, count: int) -> None:
        if count <= 0:
            return
        if count > len(self._history):
            raise RuntimeError(f"cannot roll back {count} tokens")
        self._m.rollback(count)
        self._tracker.restore(self._history[-count])
        del self._history[-count:]

    def forced_bytes(self) -> bytes:
        return self._m.forced_bytes()

    @property
    def terminated(self) -> bool:
        return self._m.terminated
