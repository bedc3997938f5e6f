"""Constrained decoding, one facade for the engine and the HTTP edge.

What the rest of radixserve calls (nothing imports the modules below directly):

- ``GRAMMAR_KINDS``, ``check_grammar(kind, text)``: the edge's check that a grammar parses and
  that a backend enforces it exactly (else ``ValueError`` / ``UnsupportedSchema``, a 400
  there); ``grammar_backend(kind, text)`` names that backend;
- ``GrammarCompiler`` (per model vocabulary: ``start(kind, text) -> GrammarState``),
  ``GrammarStats``: the engine's compile queue and its counters (requests by backend too);
- ``GrammarState``: one request's matcher; ``forced_tokens(limit)`` proposes the tokens the
  grammar forces next (a draft) and ``settle(drafted, kept, token)`` takes the outcome;
- ``apply_masks(logits, spans)``: the sampler's token bitmasks, draft rows included.

Inside: ``grammar`` (the backend choice, compilation, matcher state, masks), ``backend`` (the
interface of a grammar engine), ``xgrammar_backend`` and ``llguidance_backend`` (the two
engines, tried in that order), ``jump_forward`` (grammar-forced tokens proposed as a draft),
``schema_walk`` (the sub-schemas of a document), ``schema_support`` / ``schema_rewrite`` /
``schema_document`` / ``schema_forms`` / ``schema_merge`` / ``schema_types`` /
``schema_conditions`` / ``schema_patterns`` / ``schema_dynamic`` (which JSON Schemas xgrammar
enforces exactly, and exact rewrites of some that it does not), ``regex_support`` (pattern
constructs xgrammar drops), ``regex_ast`` / ``regex_exclude`` (patterns read into a tree, and exact
lookahead-free forms written from it).
"""

from radixserve.structured.grammar import (
    GRAMMAR_KINDS,
    GrammarCompiler,
    GrammarState,
    GrammarStats,
    apply_masks,
    check_grammar,
    grammar_backend,
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
    "grammar_backend",
]
