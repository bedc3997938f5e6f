"""The tokens of one vocabulary by what they can do to a JSON text, so that only a few are
tried on the ``Tracker`` when distinct items are enforced (``unique_matcher``).

Every class is a packed bitmask of ``uint32`` words (bit ``t % 32`` of word ``t // 32``,
like the grammar's masks), so ``words & class`` intersects it with what the grammar allows
in a few microseconds. ``closes`` indexes the tokens that end a string from inside it, by
their text before the closing quote: where a string is the start of an earlier item, the
tokens that close it on the rest of that item are one look-up away.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

_SEPARATORS = b"[{,: "
_ENDS = frozenset(b",]}")


class TokenClasses:
    """Built once per vocabulary (``token_bytes``: each token id's text)."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        self.bytes = list(token_bytes[:vocab_size]) + [b""] * (vocab_size - len(token_bytes))
        self.closes: dict[bytes, list[int]] = defaultdict(list)
        words = (vocab_size + 31) // 32

        def mask() -> np.ndarray:
            return np.zeros(words, dtype=np.uint32)

        # a quote; a backslash before the first quote; two / three quotes; a quote followed
        # by something / by the start of another value; a literal's first letter (after
        # separators); one of , ] }
        self.quote, self.escaped, self.two_quotes, self.three_quotes = (mask() for _ in range(4))
        self.quote_more, self.quote_value, self.literal, self.ends = (mask() for _ in range(4))
        for t, b in enumerate(self.bytes):
            bit = np.uint32(1 << (t & 31))
            if b.lstrip(_SEPARATORS)[:1] in (b"t", b"f", b"n"):
                self.literal[t >> 5] |= bit
            if _ENDS & set(b):
                self.ends[t >> 5] |= bit
            q = b.find(b'"')
            if q < 0:
                continue
            for cls, holds in (
                (self.quote, True),
                (self.escaped, b"\\" in b[:q]),
                (self.two_quotes, b.count(b'"') >= 2),
                (self.three_quotes, b.count(b'"') >= 3),
                (self.quote_more, q < len(b) - 1),
                (self.quote_value, bool(b[q + 1 :].strip(b" ,]}:"))),
            ):
                if holds:
                    cls[t >> 5] |= bit
            if b"\\" not in b[:q]:
                self.closes[b[:q]].append(t)
        self.structure = self.literal | self.ends | self.two_quotes


def token_ids(words: np.ndarray, size: int) -> list[int]:
    """The token ids below ``size`` whose bits are set in ``words``."""
    at = np.flatnonzero(words)
    if not len(at):
        return []
    bits = (words[at, None] >> np.arange(32, dtype=np.uint32)) & 1
    rows, cols = np.nonzero(bits)
    ids = at[rows] * 32 + cols
    return ids[ids < size].tolist()
