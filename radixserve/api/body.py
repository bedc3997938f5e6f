"""The base of every request body, and the one place a request's sampling fields become
``SamplingParams``.

``Body``: strict types (``true`` is not a count, ``2.5`` is not an integer), finite floats,
unknown fields refused, no string anywhere holding a lone surrogate (the tokenizer cannot
encode one), and ``cache_salt``, which puts the request's prefixes in a cache namespace of
their own. ``Sampling``: the fields chat and text completions share (OpenAI's names and the
common extensions), turned into ``SamplingParams`` by ``build_params`` over the server's
defaults, so a bad value is a 400 naming the field as the client wrote it.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from radixserve.api.chat_input import CachePoint
from radixserve.api.constraints import grammar_from, parse_logit_bias
from radixserve.api.errors import ApiError
from radixserve.engine.sampling_params import SEED_MAX, SamplingParams

# a token id as a request may give it: beyond int32 no vocabulary reaches, and the engine's
# messages carry 64-bit integers at most, so a bigger number is a 400 here
MAX_TOKEN_ID = 2**31


def _token_id(v: int) -> int:
    if not 0 <= v < MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, 2^31), got {v}")
    return v


TokenId = Annotated[int, AfterValidator(_token_id)]

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_SALT_CHARS = 256


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        if isinstance(key, str) and lone_surrogate_at(key) is not None:
            return path or "body"
        found = lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class Body(BaseModel):
    """A request body: strict types, and every string valid Unicode."""

    model_config = STRICT
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise ValueError(f"{where} holds a lone surrogate, which is not valid Unicode")
        return data


class CachePin(BaseModel):
    """The ``cache_pin`` extension of the OpenAI-style APIs: pin the prompt's prefix through
    its first ``messages`` messages (all of them when left out) for ``ttl`` ("5m", "1h" or
    seconds, at most an hour), as ``cache_control`` does in the Messages API."""

    model_config = STRICT
    ttl: Literal["5m", "1h"] | Annotated[int, Field(ge=1, le=3600)] = "5m"
    messages: int | None = Field(default=None, ge=1)

    def points(self, num_messages: int) -> tuple[CachePoint, ...]:
        n = num_messages if self.messages is None else self.messages
        if n > num_messages:
            raise ApiError(
                400,
                f"cache_pin.messages is {n} but the conversation has {num_messages} messages",
                "cache_pin",
            )
        return (CachePoint(n - 1, self.ttl),)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Sampling(Body):
    """Fields shared by chat and text completions (OpenAI names plus common extensions)."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None  # an end-user id for the caller's logs; no effect on generation
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # extensions (as in vLLM / SGLang): constrained output, at most one
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None
    # extensions (as in vLLM / SGLang)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def _unsupported(self) -> dict[str, Any]:
        return {}

    def grammar(self) -> tuple[str, str] | None:
        """The output constraint this request asks for (checked), or None."""
        given = {"regex": self.regex, "ebnf": self.ebnf, "json_schema": self.json_schema}
        return grammar_from(given)

    def reject_unsupported(self) -> None:
        for name, value in self._unsupported().items():
            if value not in (None, False):
                raise ApiError(400, f"parameter {name!r} is not supported by this server", name)
        if not 1 <= self.n <= 16:
            raise ApiError(400, "n must be between 1 and 16", "n")
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400, "stream_options is only allowed with stream: true", "stream_options"
            )

    def choice_params(self, defaults: dict[str, Any]) -> list[SamplingParams]:
        """Validated sampling parameters for each of the ``n`` choices (seeds differ);
        ``defaults`` fill what the request leaves out."""
        self.reject_unsupported()
        return [self.to_sampling_params(defaults, i) for i in range(self.n)]

    def to_sampling_params(self, defaults: dict[str, Any], seed_offset: int = 0) -> SamplingParams:
        raise NotImplementedError

    def sampling_params(
        self,
        defaults: dict[str, Any],
        max_tokens: int | None,
        logprobs: int | None,
        seed_offset: int = 0,
    ) -> SamplingParams:
        seed = self.seed
        if seed is not None and seed <= SEED_MAX < seed + seed_offset:
            seed -= 2**64  # wrap, so that choice i's seed stays within what torch takes
        fields = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": None if seed is None else seed + seed_offset,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": [self.stop] if isinstance(self.stop, str) else (self.stop or []),
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": parse_logit_bias(self.logit_bias),
        }
        return build_params(fields, defaults)


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def build_params(
    fields: dict[str, Any], defaults: dict[str, Any], where: str = ""
) -> SamplingParams:
    """``SamplingParams`` from what a request gave (None: left out), over ``defaults``.
    A ``max_tokens`` left out with no default means up to the context. ``where`` prefixes
    the field names in errors (``"sampling_params."`` for ``/generate``), so a message names
    the field as the client wrote it."""
    unknown = [k for k in fields if k not in SAMPLING_FIELDS]
    if unknown:
        name = where + unknown[0]
        raise ApiError(
            400,
            f"{name} is not supported; the supported fields are {', '.join(SAMPLING_FIELDS)}",
            name,
        )
    given = {k: v for k, v in fields.items() if v is not None}
    merged = {"max_tokens": None, **defaults, **given}
    try:
        return SamplingParams(**merged)
    except ValueError as e:
        param = _param_named_in(str(e), merged)
        message = where + str(e) if param else str(e)
        raise ApiError(400, message, where + param if param else None) from e


def _param_named_in(message: str, fields: dict[str, Any]) -> str | None:
    return next((name for name in fields if message.startswith(name)), None)
