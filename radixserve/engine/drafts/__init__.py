"""Drafts: tokens proposed for a request's next step, verified by the model in that step.

What the engine calls (nothing imports the modules below directly):

- ``DraftSource`` / ``Proposal``: the interface a source implements (``source.py``);
  ``GrammarSource`` (the text a grammar forces), ``TextSource`` (the request's own text);
- ``Drafts``: the core's entry (``after_tokens``, ``verified``) with its ``LengthPolicy``
  (``policy.py``: expected kept tokens against the cost of a row) and ``DraftStats``;
- ``build_drafts(config, eos_token_ids)``: the sources and policy an engine's config names.
"""

from __future__ import annotations

from radixserve.config import DraftConfig
from radixserve.engine.drafts.drafting import Drafts, DraftStats, SourceStats
from radixserve.engine.drafts.policy import LengthPolicy
from radixserve.engine.drafts.source import (
    DraftSource,
    GrammarSource,
    Proposal,
    TextSource,
    longest_match,
)

__all__ = [
    "DraftSource",
    "DraftStats",
    "Drafts",
    "GrammarSource",
    "LengthPolicy",
    "Proposal",
    "SourceStats",
    "TextSource",
    "build_drafts",
    "longest_match",
]


def build_drafts(
    config: DraftConfig, eos_token_ids: frozenset[int], extra: dict[str, DraftSource] | None = None
) -> Drafts:
    """The draft sources ``config.draft_sources`` names, in that order (``extra``: sources
    the engine builds itself, such as the cache's index, by name)."""
    known: dict[str, DraftSource] = {"grammar": GrammarSource(), "text": TextSource()}
    known.update(extra or {})
    sources = [known[name] for name in config.draft_sources if name in known]
    policy = LengthPolicy(config.draft_row_cost, config.max_draft_tokens)
    return Drafts(sources, policy, config.draft_max_batch, eos_token_ids)
