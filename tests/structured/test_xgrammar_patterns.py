"""Patterns as xgrammar compiles them: the grammar takes a string exactly when the pattern
matches it (Python's ``re``), over random patterns with optional groups (xgrammar 0.2.9
reads some ``(...)?`` too loosely unless they are spelled ``{0,1}``)."""

from __future__ import annotations

import random
import re

import pytest

from radixserve.structured.regex_support import optional_groups_spelled_out
from testing.grammar_walk import xgrammar_judge

ATOMS = ["a", "b", "[ab]", "c*", "[^a]*", "\\d", "b+", "a?", "[?)]"]


def _pattern(rng: random.Random, depth: int = 0) -> str:
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice(ATOMS)
    if r < 0.55:
        return _pattern(rng, depth + 1) + _pattern(rng, depth + 1)
    if r < 0.7:
        return f"({_pattern(rng, depth + 1)}|{_pattern(rng, depth + 1)})"
    return f"({_pattern(rng, depth + 1)})" + rng.choice(["?", "??", "*", "+", "{1,2}"])


def test_optional_groups_are_spelled_out_and_nothing_else_moves():
    assert optional_groups_spelled_out("^x(ab*)?y$") == "^x(ab*){0,1}y$"
    assert optional_groups_spelled_out("(?:a)??[)?]\\)?") == "(?:a){0,1}?[)?]\\)?"


@pytest.mark.parametrize("pattern, taken, refused", [
    ("^x(ab*)?y$", ["xy", "xaby", "xabby"], ["xby", "xbby"]),
    ("^(a*b)?$", ["", "b", "aab"], ["a", "aa"]),
])  # fmt: skip
def test_an_optional_group_takes_only_what_it_matches(pattern, taken, refused):
    judge = xgrammar_judge({"type": "string", "pattern": pattern})
    assert all(judge(s) for s in taken) and not any(judge(s) for s in refused)


def test_random_patterns_take_exactly_what_they_match():
    rng = random.Random(3)
    for _ in range(60):
        pattern = f"^{_pattern(rng)}$"
        judge = xgrammar_judge({"type": "string", "pattern": pattern})
        for _ in range(25):
            s = "".join(rng.choice("abc1?)") for _ in range(rng.randint(0, 5)))
            assert judge(s) == bool(re.search(pattern, s)), (pattern, s)
