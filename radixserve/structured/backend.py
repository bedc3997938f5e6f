"""What a grammar engine gives constrained decoding: the interface both backends implement.

A ``Backend`` (one per engine: ``xgrammar_backend``, ``llguidance_backend``) has a ``name``
and two duties:

- ``prepare(kind, text)``: without a vocabulary, the grammar text it would compile for a
  request's ``(kind, text)``, or ``UnsupportedSchema`` (a construct it would not enforce
  exactly, with its path) / ``ValueError`` (the grammar is invalid). Deterministic: the
  HTTP edge and the engine process call it on the same text and get the same answer.
- ``vocabulary(hf_tokenizer, vocab_size, stop_token_ids)``: a ``Vocabulary`` that compiles
  prepared texts for one model and makes a ``Matcher`` per request from a compiled grammar.

A ``Matcher`` is one request's position in its grammar: it fills a row of a packed token
bitmask (int32 words, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed),
accepts tokens, rolls back the last ones (a draft the model did not keep), says what text
the grammar forces next, and whether it is complete.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Matcher(Protocol):
    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""

    def accept(self, token: int) -> bool:
        """Advance over ``token``; False (and no move) where the grammar refuses it."""

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens."""

    def forced_bytes(self) -> bytes:
        """The text every continuation starts with (maybe empty)."""

    @property
    def terminated(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence can follow."""


class Vocabulary(Protocol):
    def compile(self, kind: str, prepared: str) -> Any:
        """A compiled grammar (shared by every request with that grammar)."""

    def matcher(self, compiled: Any) -> Matcher: ...


class Backend(Protocol):
    name: str

    def prepare(self, kind: str, text: str) -> str: ...

    def vocabulary(self, hf_tokenizer: Any, vocab_size: int,
                   stop_token_ids: list[int]) -> Vocabulary: ...  # fmt: skip


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A packed bitmask of ``rows`` rows, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
