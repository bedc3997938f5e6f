"""The draft-source interface, and the two sources that need nothing but the request.

A *draft source* proposes the tokens a request may write next; the model verifies them in
one step and keeps them as far as it agrees (``sampler.py``), so a proposal changes how fast
a request goes, never what it writes. ``propose(req, limit)`` returns a ``Proposal`` (at most
``limit`` tokens) or None; ``match`` is the source's confidence as a length in tokens (how
much of the text before the proposal it matched), which the length policy buckets its
acceptance by (``policy.py``). Sources are stateless across requests unless they say so
(the cache's index is shared by its namespace, never across namespaces).

- ``GrammarSource``: the text a request's grammar forces next (jump forward, ``structured/``);
- ``TextSource``: the request's own text (prompt and output so far): the continuation after
  the longest earlier match of its last tokens (``longest_match``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixserve.engine.request import Request

MAX_MATCH = 64  # a longer match says no more about the continuation


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    match: int  # tokens of context the source matched before proposing (its confidence)


class DraftSource:
    """Proposes a request's next tokens; ``name`` labels its statistics."""

    name = "source"

    def propose(self, req: Request, limit: int) -> Proposal | None:
        raise NotImplementedError


class GrammarSource(DraftSource):
    """The tokens a constrained request's grammar forces next (``GrammarState.forced_tokens``:
    the model's remembered spelling of the forced text, else the tokenizer's)."""

    name = "grammar"

    def propose(self, req: Request, limit: int) -> Proposal | None:
        if req.grammar is None:
            return None
        tokens = req.grammar.forced_tokens(limit)
        return Proposal(tokens, len(tokens)) if tokens else None


def longest_match(ids: np.ndarray, max_len: int = MAX_MATCH) -> tuple[int, int] | None:
    """Where the longest earlier occurrence of ``ids``' last tokens ends, as ``(end, length)``:
    ``ids[end - length + 1 : end + 1] == ids[-length:]`` with ``end < len(ids) - 1`` (so at
    least one token follows it); the most recent of the longest; None without any.

    Candidates narrow one token back at a time, vectorized over every earlier occurrence, so
    a lookup costs a scan of ``ids`` plus a few small array operations."""
    n = len(ids)
    if n < 2:
        return None
    ends = np.flatnonzero(ids[:-1] == ids[-1])
    length = 1
    while ends.size and length < max_len and length < n:
        back = ends - length
        ok = back >= 0
        ok[ok] = ids[back[ok]] == ids[n - 1 - length]
        if not ok.any():
            break
        ends = ends[ok]
        length += 1
    return (int(ends[-1]), length) if ends.size else None


class TextSource(DraftSource):
    """The request's own text: after the longest earlier match of its last tokens comes
    what followed that match (a file quoted in the prompt and written back, a repeated
    pattern in the output)."""

    name = "text"

    def __init__(self, max_match: int = MAX_MATCH):
        self.max_match = max_match

    def propose(self, req: Request, limit: int) -> Proposal | None:
        ids = req.token_ids
        found = longest_match(ids, self.max_match)
        if found is None or limit <= 0:
            return None
        end, length = found
        return Proposal(ids[end + 1 : end + 1 + limit].tolist(), length)
