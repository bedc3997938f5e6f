"""OpenAI-compatible request bodies, and the one place they become ``SamplingParams``.

Every field is either honoured or rejected: unknown fields fail validation (``extra=forbid``)
and known OpenAI fields we do not implement (tools, logit_bias, ...) are refused with a
message naming them, unless they carry their neutral value. ``ApiError`` carries the HTTP
status and the offending parameter to the OpenAI-style error body.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.engine.sampling_params import SamplingParams


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            message,
            param,
            kind,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by chat and text completions (OpenAI names plus common extensions)."""

    model_config = ConfigDict(extra="forbid")

    model: str
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
    # unsupported OpenAI fields: accepted only with their neutral value
    logit_bias: dict[str, float] | None = None
    # extensions (as in vLLM / SGLang)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def _unsupported(self) -> dict[str, Any]:
        return {"logit_bias": self.logit_bias or None}

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

    def choice_params(self) -> list[SamplingParams]:
        """Validated sampling parameters for each of the ``n`` choices (seeds differ)."""
        self.reject_unsupported()
        return [self.to_sampling_params(i) for i in range(self.n)]

    def to_sampling_params(self, seed_offset: int = 0) -> SamplingParams:
        raise NotImplementedError

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0
    ) -> SamplingParams:
        fields = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": None if self.seed is None else self.seed + seed_offset,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": [self.stop] if isinstance(self.stop, str) else (self.stop or []),
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
        }
        try:
            # None means "the default", except for max_tokens where it means "up to the context"
            given = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
            return SamplingParams(**given)
        except ValueError as e:
            raise ApiError(400, str(e), _param_named_in(str(e), fields)) from e


def _param_named_in(message: str, fields: dict[str, Any]) -> str | None:
    return next((name for name in fields if message.startswith(name)), None)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def _unsupported(self) -> dict[str, Any]:
        fmt = self.response_format
        return {
            **super()._unsupported(),
            "tools": self.tools or None,
            "tool_choice": None if self.tool_choice in (None, "none") else self.tool_choice,
            "functions": self.functions or None,
            "function_call": None if self.function_call in (None, "none") else self.function_call,
            "response_format": None if fmt in (None, {"type": "text"}) else fmt,
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    def to_sampling_params(self, seed_offset: int = 0) -> SamplingParams:
        if not self.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, logprobs, seed_offset)

    def conversation(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported(self) -> dict[str, Any]:
        return {
            **super()._unsupported(),
            "echo": self.echo,
            "suffix": self.suffix,
            "best_of": None if self.best_of in (None, 1, self.n) else self.best_of,
        }

    def to_sampling_params(self, seed_offset: int = 0) -> SamplingParams:
        # OpenAI's default for completions is 16 tokens
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, seed_offset)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class GenerateRequest(BaseModel):
    """The native endpoint: token ids (or text) in, token ids out."""

    model_config = ConfigDict(extra="forbid")
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False

    def to_sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(**self.sampling_params)
        except TypeError as e:
            raise ApiError(400, f"unknown sampling parameter: {e}", "sampling_params") from e
        except ValueError as e:
            raise ApiError(400, str(e), "sampling_params") from e
