"""SamplingParams: how to pick tokens and when to stop, validated on construction.

This is the one place request parameters are checked; the HTTP layer maps OpenAI fields onto
it and turns its ``ValueError`` into an HTTP 400. ``validate`` checks types strictly (a bool
is not an integer, a float is not a count), keeps floats finite and integers within what the
sampler and ``torch.Generator`` accept. The engine calls it again on every request it is
given, because parameters that crossed a process boundary were unpickled without
``__post_init__`` running: a bad request is refused alone, never crashes a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 64
INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
GREEDY_TEMPERATURE = 1e-5  # below this, dividing logits by the temperature overflows


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_text(name: str, s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds a lone surrogate, which is not valid Unicode") from e


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off; above the vocabulary: off too
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI-style, over output tokens
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus top-k
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        self._number("temperature", 0.0, math.inf)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        self._number("min_p", 0.0, 1.0)
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        self._number("frequency_penalty", -2.0, 2.0)
        self._number("presence_penalty", -2.0, 2.0)
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for s in self.stop:
            _check_text("stop", s)
        if not isinstance(self.stop_token_ids, list) or any(
            not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}, "
                f"got {self.logprobs!r}"
            )
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if not isinstance(self.logit_bias, dict) or any(
            not _is_int(t) or t < 0 or not _is_number(b) or not -100 <= b <= 100
            for t, b in self.logit_bias.items()
        ):
            raise ValueError(
                "logit_bias must map token ids (non-negative integers) to numbers in [-100, 100]"
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def _number(self, name: str, low: float, high: float) -> None:
        value = getattr(self, name)
        if not _is_number(value) or not low <= value <= high:
            bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise ValueError(f"{name} must be a finite number {bounds}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
