"""Jump-forward drafts: which tokens to compute ahead where a grammar forces the next text.

A draft is only a guess: the sampler keeps it up to the first token the model would not
have drawn itself (``sampler.py``), so what a draft holds changes the speed, never the
output. Two sources, per forced text:

- *The model's own spelling*: ``Drafter`` remembers, for each forced text it has seen, the
  tokens the model wrote over it (the last ``MEMORY_SIZE`` texts, shared by the engine's
  requests). A constrained small model often spells a forced key in pieces of its own
  choosing (SmolLM2 writes ``priority`` as ``p``, ``ri``, ``or``, ``it``, ``y`` once the grammar
  forces it), and the next request with the same schema usually spells it the same way. A
  remembered spelling is drafted whole.
- *The tokenizer's encoding* of the forced text otherwise, sized by how much of the
  request's last such draft the model kept (``Drafting``): the first has
  ``FIRST_DRAFT_TOKENS``; one kept whole doubles the next, one cut short sizes the next to
  what was kept, and one of which fewer than ``MIN_DRAFT_TOKENS`` were kept pauses these
  drafts for ``DRAFT_PAUSE`` draws. Shorter drafts are not made: a draft row costs about
  what a decode step's row does, so a wasted one is a loss.

The tokens the model writes while a forced text is in front of it are what ``Drafting``
watches, token by token, to teach ``Drafter`` that text's spelling.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

# measured in docs/structured-output.md (jump forward)
FIRST_DRAFT_TOKENS, MIN_DRAFT_TOKENS, DRAFT_PAUSE = 2, 2, 8
MEMORY_SIZE = 4096  # forced texts whose spellings are remembered
SPELLINGS_PER_TEXT = 4


class Drafter:
    """Drafts a forced text for one vocabulary: the model's remembered spellings of it, else
    the tokenizer's encoding; either cut before any stop token."""

    def __init__(self, hf_tokenizer: Any, stop_token_ids: list[int], token_bytes: list[bytes]):
        self._encode = hf_tokenizer.encode
        self._stops = frozenset(stop_token_ids)
        self.token_bytes = token_bytes  # each token id's text as bytes
        self._spellings: OrderedDict[bytes, list[list[int]]] = OrderedDict()

    def spellings(self, text: bytes) -> list[list[int]]:
        """The last ``SPELLINGS_PER_TEXT`` distinct token runs the model wrote over ``text``
        (each up to the end of the text, or up to a token that ran past it)."""
        found = self._spellings.get(text)
        if found is None:
            return []
        self._spellings.move_to_end(text)
        return found

    def learn(self, text: bytes, tokens: list[int]) -> None:
        known = [s for s in self._spellings.pop(text, []) if s != tokens]
        self._spellings[text] = [*known[-(SPELLINGS_PER_TEXT - 1) :], tokens]
        while len(self._spellings) > MEMORY_SIZE:
            self._spellings.popitem(last=False)

    def encode(self, text: str, limit: int) -> list[int]:
        ids = self._encode(text, add_special_tokens=False)[:limit] if text else []
        return self.cut_at_stop(ids)

    def cut_at_stop(self, ids: list[int]) -> list[int]:
        for i, t in enumerate(ids):
            if t in self._stops:
                return ids[:i]
        return ids


class Drafting:
    """One request's drafts: sizing of the tokenizer's drafts, and the forced text it is
    watching the model spell."""

    def __init__(self, drafter: Drafter):
        self._drafter = drafter
        self._limit = FIRST_DRAFT_TOKENS  # of the next tokenizer draft
        self._pause = 0  # draws left before a tokenizer draft again
        self._remembered = False  # whether the last draft was a remembered spelling
        # the forced text being watched, how many of its bytes the model wrote, with what
        self._text, self._done, self._spelled = b"", 0, []

    def propose(self, forced: str, limit: int) -> list[int]:
        """A draft (at most ``limit`` tokens, maybe none) where ``forced`` is forced next."""
        if forced and not self._text:
            self._text, self._done, self._spelled = forced.encode(), 0, []
        self._remembered = False
        if limit <= 0 or not forced:
            return []
        if self._text:
            written = len(self._spelled)
            known = [k[written:] for k in self._drafter.spellings(self._text)
                     if k[:written] == self._spelled]  # fmt: skip
            if known:  # as far as every spelling that fits what the model wrote agrees
                self._remembered = True
                return self._drafter.cut_at_stop(_common_prefix(known))[:limit]
        if self._pause:
            return []
        draft = self._drafter.encode(forced, min(limit, self._limit))
        return draft if len(draft) >= MIN_DRAFT_TOKENS else []

    def settle(self, draft: list[int], kept: int, token: int, own: bool = True) -> None:
        """``kept`` tokens of ``draft`` were kept, then ``token`` was drawn; ``own``: the draft
        was this request's proposal (another source's draft does not size these)."""
        drafted = len(draft) if own else 0
        if drafted and not self._remembered:
            if kept < drafted:
                self._limit = max(MIN_DRAFT_TOKENS, kept)
                self._pause = DRAFT_PAUSE if kept < MIN_DRAFT_TOKENS else 0
            elif drafted >= self._limit:
                self._limit = 2 * drafted
        elif not drafted and self._pause:
            self._pause -= 1
        for t in [*draft[:kept], token]:
            self._watch(t)

    def _watch(self, token: int) -> None:
        if not self._text:
            return
        piece = self._drafter.token_bytes[token]
        end = self._done + len(piece)
        if piece and self._text[self._done : end] == piece:
            self._done = end
            self._spelled.append(token)
            if end < len(self._text):
                return
        if self._spelled:  # the whole text, or up to a token that ran past it
            self._drafter.learn(self._text, self._spelled)
        self._text, self._done, self._spelled = b"", 0, []


def _common_prefix(runs: list[list[int]]) -> list[int]:
    first = runs[0]
    n = len(first)
    for run in runs[1:]:
        n = min(n, len(run))
        n = next((i for i in range(n) if run[i] != first[i]), n)
    return first[:n]
