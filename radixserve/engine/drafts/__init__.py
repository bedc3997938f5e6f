"""Drafts: tokens proposed for a request's next step, verified by the model in that step.

What the engine calls (nothing imports the modules below directly):

- ``DraftSource`` / ``Proposal``: the interface a source implements (``source.py``);
  ``GrammarSource`` (the text a grammar forces), ``TextSource`` (the request's own text);
- ``Drafts``: the core's entry (``after_tokens``, ``verified``) with its ``LengthPolicy``
  (``policy.py``: expected kept tokens against the cost of a row) and ``DraftStats``;
- ``CacheSource`` / ``NgramIndex``: what the prefix cache holds of the request's namespace
  (``cache_index.py``: an n-gram index kept by the tree's listener calls);
- ``build_drafts(config, eos_token_ids, cache)``: the sources and policy an engine's config
  names (the cache's source only over a radix tree: a cache without prefixes has no text).
"""

from __future__ import annotations

from radixserve.cache import PrefixCache, RadixCache
from radixserve.config import DraftConfig
from radixserve.engine.drafts.cache_index import CacheSource, NgramIndex
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
    "CacheSource",
    "NgramIndex",
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
    config: DraftConfig, eos_token_ids: frozenset[int], cache: PrefixCache | None = None
) -> Drafts:
    """The draft sources ``config.draft_sources`` names, in that order; ``cache``'s n-gram
    index listens to its tree from now on when ``cache`` is named and is a radix tree."""
    known: dict[str, DraftSource] = {"grammar": GrammarSource(), "text": TextSource()}
    if "cache" in config.draft_sources and isinstance(cache, RadixCache):
        index = NgramIndex()
        cache.add_listener(index)
        known["cache"] = CacheSource(index)
    sources = [known[name] for name in config.draft_sources if name in known]
    policy = LengthPolicy(config.draft_row_cost, config.max_draft_tokens)
    return Drafts(sources, policy, config.draft_max_batch, eos_token_ids)
