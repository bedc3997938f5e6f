"""Drafts: the core's one entry to its draft sources, their length policy and statistics.

After each step the core hands every request that drew tokens (and goes on) to
``after_tokens``: the predictions of its sources are checked against what it wrote
(``policy.py``), then, unless the batch is too large or the request cannot use a draft
(penalties, whose rows depend on the draft's own tokens; one token left), every source
proposes, each proposal is cut before any token that would stop the request, sized by the
length policy, and the one expected to keep the most tokens is appended to the request as
its draft (``Request.add_draft``). The next step computes it with the token before it, a row
each; the sampler keeps it as far as the model agrees, and the core reports that here
(``verified``), which is what the statistics count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.engine.drafts.policy import (
    LengthPolicy,
    Prediction,
    RequestDrafting,
    bucket,
    expected_kept,
)
from radixserve.engine.drafts.source import DraftSource
from radixserve.engine.request import Request


@dataclass
class SourceStats:
    steps: int = 0  # steps that verified a draft of this source
    proposed_tokens: int = 0  # draft tokens computed
    accepted_tokens: int = 0  # of which kept: output tokens that took no step of their own

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per verifying step (the kept ones plus the token drawn after them)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0


@dataclass
class DraftStats:
    sources: dict[str, SourceStats] = field(default_factory=dict)  # by source name

    def copy(self) -> DraftStats:
        return DraftStats({k: SourceStats(**vars(v)) for k, v in self.sources.items()})


@dataclass(frozen=True)
class Candidate:
    source: str
    tokens: list[int]
    gain: float  # expected tokens kept


class Drafts:
    def __init__(
        self,
        sources: Sequence[DraftSource],
        policy: LengthPolicy,
        max_batch: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        self.sources, self.policy, self.max_batch = list(sources), policy, max_batch
        self.eos_token_ids = eos_token_ids
        self.stats = DraftStats({s.name: SourceStats() for s in self.sources})

    def after_tokens(self, req: Request, written: list[int], batch: int) -> None:
        """``req`` wrote ``written`` this step and goes on in a batch of ``batch`` requests:
        check its predictions, then maybe give it a draft."""
        state = req.drafting
        if state is None:
            state = req.drafting = RequestDrafting()
        state.source = None
        self._check(state, written)
        if batch > self.max_batch or req.params.needs_penalties:
            return
        limit = req.remaining_output - 1  # the token drawn after the draft counts too
        if limit <= 0:
            return
        best = None
        for source in self.sources:
            c = self._candidate(req, state, source, limit, batch)
            if c is not None and (best is None or c.gain > best.gain):
                best = c
        if best is not None:
            req.add_draft(best.tokens)
            state.source = best.source

    def _check(self, state: RequestDrafting, written: list[int]) -> None:
        for name, p in list(state.pending.items()):
            decided = p.check(written)
            if decided is not None:
                self.policy.learn(state, p, *decided)
                del state.pending[name]

    def _candidate(
        self, req: Request, state: RequestDrafting, source: DraftSource, limit: int, batch: int
    ) -> Candidate | None:
        proposal = source.propose(req, min(limit, self.policy.max_tokens))
        if proposal is None:
            return None
        tokens = self._cut_at_stop(req, proposal.tokens)
        if not tokens:
            return None
        b = bucket(proposal.match)
        if source.name not in state.pending:
            state.pending[source.name] = Prediction(source.name, b, tokens)
        rate = self.policy.rate(state, source.name, b)
        k = self.policy.length(rate, batch, len(tokens))
        return Candidate(source.name, tokens[:k], expected_kept(rate, k)) if k else None

    def _cut_at_stop(self, req: Request, tokens: list[int]) -> list[int]:
        """``tokens`` up to the first that would end the request (a draft token is output once
        kept, and the core checks only the token drawn after it)."""
        p = req.params
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops |= self.eos_token_ids
        for i, t in enumerate(tokens):
            if t in stops:
                return tokens[:i]
        return tokens

    def verified(self, req: Request, drafted: int, kept: int) -> None:
        """``req``'s draft of ``drafted`` tokens was computed and ``kept`` of them kept."""
        state = req.drafting
        if state is None or state.source is None:
            return
        s = self.stats.sources[state.source]
        s.steps += 1
        s.proposed_tokens += drafted
        s.accepted_tokens += kept
        state.source = None
