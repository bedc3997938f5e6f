"""Exact forms, without lookaheads, of string constraints the grammar engines do not enforce.

- ``lookahead_free(s)``: ``s`` with each ``pattern`` (and ``patternProperties`` pattern) that
  opens with a lookahead of literal words, ``^(?!w1|w2)R$``, as the same set of strings
  without it (``regex_exclude.without_lookahead``); other patterns as they were.
- ``not_listed_strings(s, negated)``: ``s`` (a schema of strings only) without its ``not``,
  where the ``not`` (``negated``, flat: ``$ref`` inlined) only lists values: the strings
  ``s`` allows but those values, as one ``pattern`` (``regex_exclude.excluding``: beside
  an anchored ``pattern`` of ``s``, or none).

Each returns None where its form does not apply or the pattern cannot be written exactly
(the schema stays refused, naming the construct).
"""

from __future__ import annotations

from typing import Any

from radixserve.structured.regex_ast import RegexUnsupported
from radixserve.structured.regex_exclude import excluding, without_lookahead
from radixserve.structured.regex_support import pattern_problem
from radixserve.structured.schema_forms import listed_values
from radixserve.structured.schema_types import expand


def _rewritten(pattern: Any) -> str | None:
    """``pattern`` without its opening lookahead, or None (no lookahead, or no exact form)."""
    problem = pattern_problem(pattern) if isinstance(pattern, str) else None
    if not (problem and "lookahead" in problem and "lookbehind" not in problem):
        return None
    try:
        return without_lookahead(pattern)
    except RegexUnsupported:
        return None


def lookahead_free(s: dict) -> dict | None:
    out = dict(s)
    new = _rewritten(s.get("pattern"))
    if new is not None:
        out["pattern"] = new
    props = s.get("patternProperties")
    if isinstance(props, dict):
        renamed = {(_rewritten(k) or k): v for k, v in props.items()}
        if len(renamed) == len(props) and list(renamed) != list(props):
            out["patternProperties"] = renamed
    return None if out == s else out


def not_listed_strings(s: dict, negated: Any) -> dict | None:
    if not ("type" in s and expand(s["type"]) == {"string"}):
        return None
    values = listed_values(negated)
    if values is None:
        return None
    words = [v for v in values if isinstance(v, str)]
    rest = {k: v for k, v in s.items() if k != "not"}
    if not words:  # the not lists no string: every string meets it
        return rest
    pattern = rest.get("pattern")
    if "pattern" in rest and not isinstance(pattern, str):
        return None
    try:
        return {**rest, "pattern": excluding(pattern, words)}
    except RegexUnsupported:
        return None
