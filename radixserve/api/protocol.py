"""The request bodies of the endpoints: chat and text completions (OpenAI's) and the native
``/generate``, each becoming ``SamplingParams`` and the spec's other fields.

Every field is either honoured or rejected: unknown fields fail validation and known OpenAI
fields we do not implement (``functions``, ``echo``, ...) are refused with a message naming
them, unless they carry their neutral value. Constrained output (chat's ``response_format``;
the extensions ``regex``, ``ebnf`` and ``json_schema``) becomes the spec's ``grammar``,
checked here so a bad one is a 400 naming the problem. Parameters a request leaves out take
the server's defaults (the model's recommendation, see ``generation_defaults``); ``model``
may be left out too. What every body shares (strict types, valid Unicode, ``cache_salt``,
the sampling fields and ``build_params``) is ``body.py``'s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, model_validator

from radixserve.api.body import (
    STRICT,
    Body,
    Sampling,
    TokenId,
    build_params,
)
from radixserve.api.chat_input import ChatInput
from radixserve.api.constraints import grammar_from, parse_logit_bias, response_format_grammar
from radixserve.api.errors import ApiError
from radixserve.api.tools import ToolPlan
from radixserve.engine.sampling_params import SamplingParams

PLACEHOLDER = "\x00reusable\x00"  # where ChatMessage.text puts a reusable part's text


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message: the calls it made

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self, mark_reusable: bool = False) -> str:
        """The content as text; with ``mark_reusable``, each reusable part (the extension
        ``"reusable": true``, a RAG segment) replaced by ``PLACEHOLDER``."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", "messages")
            if not isinstance(part.get("reusable", False), bool):
                raise ApiError(400, "a content part's reusable must be true or false", "messages")
            reusable = part.get("reusable", False) and part["text"]
            parts.append(PLACEHOLDER if mark_reusable and reusable else part["text"])
        return "".join(parts)

    def reusable_parts(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p["text"] for p in self.content if p.get("reusable") is True and p.get("text")]


class ChatCompletionRequest(Sampling):
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
    # extension, with reusable content parts (RAG segments): share of their tokens recomputed
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)

    def _unsupported(self) -> dict[str, Any]:
        return {
            **super()._unsupported(),
            "functions": self.functions or None,
            "function_call": None if self.function_call in (None, "none") else self.function_call,
        }

    def grammar(self) -> tuple[str, str] | None:
        fmt = self.response_format
        if fmt is None or fmt == {"type": "text"}:
            return super().grammar()
        if super().grammar() is not None:
            raise ApiError(400, "give response_format or a grammar extension, not both",
                           "response_format")  # fmt: skip
        return response_format_grammar(fmt)

    def to_sampling_params(self, defaults: dict[str, Any], seed_offset: int = 0) -> SamplingParams:
        if not self.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_tokens is None else self.max_tokens
        return self.sampling_params(defaults, max_tokens, logprobs, seed_offset)

    def conversation(self, mark_reusable: bool = False) -> list[dict[str, Any]]:
        """The messages in ``ChatInput`` form (``developer`` is OpenAI's newer name for the
        system role)."""
        out = []
        for m in self.messages:
            msg = {"role": "system" if m.role == "developer" else m.role,
                   "content": m.text(mark_reusable)}  # fmt: skip
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            out.append(msg)
        return out

    def chat_input(self, defaults: dict[str, Any], mark_reusable: bool = False) -> ChatInput:
        """This request in the form the three chat APIs share (``chat_input.py``)."""
        params = self.choice_params(defaults)
        messages = self.conversation(mark_reusable)
        return ChatInput.build(messages, self.tool_plan(), self.grammar(), params,
                               salt=self.cache_salt)  # fmt: skip

    def tool_plan(self) -> ToolPlan | None:
        """What ``tools`` and ``tool_choice`` ask for (None: no tools in play)."""
        return ToolPlan.build(self.tools, self.tool_choice, self.parallel_tool_calls)

    def reusable_parts(self) -> list[str]:
        """The texts of the reusable content parts, in order (empty: no RAG segments)."""
        parts = [text for m in self.messages for text in m.reusable_parts()]
        if self.recompute_ratio is not None and not parts:
            raise ApiError(400, "recompute_ratio applies to reusable content parts only",
                           "recompute_ratio")  # fmt: skip
        return parts


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
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

    def to_sampling_params(self, defaults: dict[str, Any], seed_offset: int = 0) -> SamplingParams:
        # OpenAI's default for completions is 16 tokens
        max_tokens = defaults.get("max_tokens", 16) if self.max_tokens is None else self.max_tokens
        return self.sampling_params(defaults, max_tokens, self.logprobs, seed_offset)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema")  # /generate's sampling_params extensions

# the OpenAPI description of /generate's sampling_params: SamplingParams' own fields
_SAMPLING_SCHEMA = {
    "properties": {
        **TypeAdapter(SamplingParams).json_schema()["properties"],
        "regex": {"type": "string"},
        "ebnf": {"type": "string"},
        "json_schema": {"type": ["object", "string"]},
    },
    "additionalProperties": False,
}


class PromptSegment(BaseModel):
    """One piece of a ``/generate`` prompt given as segments: text or token ids. A reusable
    one (a retrieved passage) has its KV stored and reused wherever it appears later."""

    model_config = STRICT
    text: str | None = None
    input_ids: list[TokenId] | None = None
    reusable: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> PromptSegment:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("a segment needs exactly one of text and input_ids")
        if not (self.text or self.input_ids):
            raise ValueError("a segment may not be empty")
        return self


class GenerateRequest(Body):
    """The native endpoint: token ids (or text, or a list of segments) in, token ids out.
    ``sampling_params`` are ``SamplingParams`` fields, checked there (strictly typed, since
    JSON reaches it as is). ``recompute_ratio`` (with segments): share of the reused segment
    tokens computed again; None: the server's default."""

    input_ids: list[TokenId] | None = None
    text: str | None = None
    segments: list[PromptSegment] | None = Field(default=None, min_length=1)
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    sampling_params: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra=_SAMPLING_SCHEMA
    )
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [f for f in ("input_ids", "text", "segments") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of input_ids, text and segments")
        if self.recompute_ratio is not None and self.segments is None:
            raise ValueError("recompute_ratio applies to segments only")
        return self

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        # unlike the OpenAI endpoints, the native one keeps SamplingParams' own max_tokens
        fields = {k: v for k, v in self.sampling_params.items() if k not in GRAMMAR_FIELDS}
        if "logit_bias" in fields:
            fields["logit_bias"] = parse_logit_bias(fields["logit_bias"])
        return build_params(fields, {"max_tokens": 16, **defaults}, "sampling_params.")

    def grammar(self) -> tuple[str, str] | None:
        given = {k: self.sampling_params.get(k) for k in GRAMMAR_FIELDS}
        return grammar_from(given, "sampling_params.")
