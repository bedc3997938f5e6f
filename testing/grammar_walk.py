"""A grammar's matcher moved over a text, and the tokens it allows next, for tests that check
a constraint binds (the token that would break it is masked out)."""

from __future__ import annotations

import json
from typing import Any

import torch

from radixserve.structured.backend import Matcher, allocate_bitmask
from radixserve.structured.grammar import GrammarCompiler


def matcher_after(compiler: GrammarCompiler, hf_tokenizer: Any, schema: Any,
                  text: str) -> Matcher:  # fmt: skip
    """A matcher of ``schema``'s grammar moved over ``text``'s tokens (each must be taken)."""
    m = compiler.start("json_schema", json.dumps(schema)).matcher
    for t in hf_tokenizer.encode(text, add_special_tokens=False):
        assert m.accept(t), (text, hf_tokenizer.decode([t]))
    return m


def allowed(m: Matcher, vocab_size: int) -> torch.Tensor:
    """Which tokens the matcher allows next, as a bool per token id."""
    mask = allocate_bitmask(1, vocab_size)
    m.fill(mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1).bool()[:vocab_size]
