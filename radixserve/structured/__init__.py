"""Constrained decoding, one facade for the engine and the HTTP edge.

What the rest of radixserve calls (nothing imports the modules below directly):

- ``GRAMMAR_KINDS``, ``check_grammar(kind, text)``: the edge's check that a grammar parses and
  is enforced exactly (else ``ValueError`` / ``UnsupportedSchema``, a 400 there);
- ``GrammarCompiler`` (per model vocabulary: ``start(kind, text) -> GrammarState``),
  ``GrammarStats``: the engine's compile queue and its counters;
- ``apply_masks(logits, spans)``: the sampler's token bitmasks, draft rows included.

Inside: ``grammar`` (compilation, matcher state, masks), ``jump_forward`` (grammar-forced
tokens proposed as a draft), ``schema_support`` / ``schema_rewrite`` / ``schema_forms`` /
``schema_merge`` / ``schema_types`` (which JSON Schemas are enforced exactly, and exact
rewrites of some that are not), ``regex_support``.
"""

from radixserve.structured.grammar import (
    GRAMMAR_KINDS,
    GrammarCompiler,
    GrammarState,
    GrammarStats,
    apply_masks,
    check_grammar,
)
from radixserve.structured.schema_support import UnsupportedSchema

__all__ = [
    "GRAMMAR_KINDS",
    "GrammarCompiler",
    "GrammarState",
    "GrammarStats",
    "UnsupportedSchema",
    "apply_masks",
    "check_grammar",
]
