"""How many proposed tokens to draft: what a draft is expected to keep against what it costs.

Acceptance. Every proposal a source makes is a prediction of the request's next tokens,
checked against the tokens the request then writes, drafted or not (``Prediction``): its
tokens that came true count as kept, the first that did not as refused. So a source's
acceptance is learned also where it drafts nothing, at the price of a lookup. Counts are
kept per source and bucket of match length (a 20-token match predicts better than a 1-token
one), for all requests (slowly decaying: the prior of a new request) and per request
(quickly decaying: what this text does now). The per-token acceptance ``a`` is
``(kept + w * prior) / (kept + refused + w)``; the j-th draft token is kept with ``a ** j``.

Cost. On a CPU a step costs about ``T(r) = T0 * (1 + beta * (r - 1))`` for ``r`` rows: reading
the weights, shared by every row, then ``beta`` of that per row more (``draft_row_cost``).
A row added to a step of ``B`` rows pays when the token it may bring raises the step's
tokens per second: ``p * T > B * T0 * beta``, i.e. ``p > B * beta / (1 + beta * (B - 1))``.
One stream at ``beta = 0.1`` drafts while ``a ** j > 0.1``; sixteen need ``a ** j > 0.64``;
the more rows a step has, the surer a draft token must be. Above ``draft_max_batch``
running requests nothing is proposed at all (no lookups either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BUCKETS = (1, 2, 4, 8, 16, 32)  # lower bounds of the match-length buckets
PRIOR_RATE = 0.3  # a bucket's acceptance before anything was learned of it
PRIOR_WEIGHT = 2.0  # how many tokens' worth the prior counts for
REQUEST_DECAY = 0.8  # per prediction checked, of a request's own counts
GLOBAL_DECAY = 0.995  # per prediction checked, of the counts of every request


def bucket(match: int) -> int:
    """The bucket of a match length (0 for anything under 2 tokens)."""
    b = 0
    while b + 1 < len(BUCKETS) and match >= BUCKETS[b + 1]:
        b += 1
    return b


@dataclass
class Tally:
    """Decayed counts of predicted tokens that came true (kept) and did not (refused)."""

    kept: float = 0.0
    refused: float = 0.0

    def add(self, kept: int, refused: int, decay: float) -> None:
        self.kept = self.kept * decay + kept
        self.refused = self.refused * decay + refused

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.kept + weight * prior) / (self.kept + self.refused + weight)


@dataclass
class Prediction:
    """A proposal being checked against what the request writes next."""

    source: str
    bucket: int
    tokens: list[int]
    matched: int = 0

    def check(self, written: list[int]) -> tuple[int, int] | None:
        """Follow ``written``; ``(kept, refused)`` once decided, else None."""
        for t in written:
            if t != self.tokens[self.matched]:
                return self.matched, 1
            self.matched += 1
            if self.matched == len(self.tokens):
                return self.matched, 0
        return None


@dataclass
class RequestDrafting:
    """One request's drafting state (``Request.drafting``)."""

    tallies: dict[tuple[str, int], Tally] = field(default_factory=dict)
    pending: dict[str, Prediction] = field(default_factory=dict)  # by source name
    source: str | None = None  # the source of the draft the request carries


class LengthPolicy:
    def __init__(self, row_cost: float, max_tokens: int):
        self.row_cost, self.max_tokens = row_cost, max_tokens
        self.tallies: dict[tuple[str, int], Tally] = {}

    def learn(self, state: RequestDrafting, p: Prediction, kept: int, refused: int) -> None:
        key = (p.source, p.bucket)
        self.tallies.setdefault(key, Tally()).add(kept, refused, GLOBAL_DECAY)
        state.tallies.setdefault(key, Tally()).add(kept, refused, REQUEST_DECAY)

    def rate(self, state: RequestDrafting, source: str, b: int) -> float:
        """The per-token acceptance expected of ``source``'s proposal in bucket ``b``; the
        tokens of a prediction still being checked that came true so far count as kept (a
        long prediction coming true raises the draft length before it is decided)."""
        known = self.tallies.get((source, b))
        prior = known.rate(PRIOR_RATE) if known is not None else PRIOR_RATE
        own = state.tallies.get((source, b))
        pending = state.pending.get(source)
        so_far = pending.matched if pending is not None and pending.bucket == b else 0
        if own is None and not so_far:
            return prior
        kept, refused = (own.kept, own.refused) if own is not None else (0.0, 0.0)
        return Tally(kept + so_far, refused).rate(prior)

    def threshold(self, batch: int) -> float:
        """The least chance of being kept that pays for a draft row in a step of ``batch``
        rows (module docstring)."""
        beta = self.row_cost
        return batch * beta / (1 + beta * (batch - 1))

    def length(self, rate: float, batch: int, proposed: int) -> int:
        """How many of ``proposed`` tokens to draft at per-token acceptance ``rate``."""
        limit = min(proposed, self.max_tokens)
        theta = self.threshold(batch)
        if rate <= theta or limit <= 0:
            return 0
        if rate >= 1.0:
            return limit
        return min(limit, int(math.log(theta) / math.log(rate)))


def expected_kept(rate: float, k: int) -> float:
    """Expected tokens kept of a ``k``-token draft at per-token acceptance ``rate``."""
    return sum(rate**j for j in range(1, k + 1))
