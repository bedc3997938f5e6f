"""The Anthropic Messages API's request bodies (``POST /v1/messages`` and
``/v1/messages/count_tokens``), turned into a ``ChatInput`` (``chat_input.py``).

Honoured: ``system`` (a string or text blocks), ``text`` / ``tool_use`` / ``tool_result``
blocks (a result's content as a string or text blocks; ``is_error`` marks it in the prompt),
a ``system`` role inside ``messages``, custom ``tools`` and ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``, ``disable_parallel_tool_use``), ``stop_sequences``, ``temperature``,
``top_p``, ``top_k``, ``max_tokens`` (lowered to the context left after the prompt),
``output_config.format`` (a JSON Schema the output is constrained to). A tool with
``defer_loading: true`` is checked and left out of the prompt, as the API leaves it out of
the model's context until a tool search finds it (this server has none: a client's own
search, such as Claude Code's ``ToolSearch``, returns the definition in a tool result).

Accepted as advice, since a model without thinking has nothing to apply them to: ``thinking``
``adaptive`` or ``disabled`` (an adaptive model may choose not to think) and its ``display``,
``output_config.effort``, ``context_management`` edits that clear thinking (there is none to
clear), ``metadata`` (the router's session key), ``service_tier``, thinking blocks in the
history (dropped: they are another model's). Claude Code's attribution block (a system text
block starting ``x-anthropic-billing-header:``) is dropped: it names the client build and would
change the first tokens of every prompt, which no cache could then reuse.

``cache_control`` (on system, tool, text, tool_use and tool_result blocks, and top level): the
prefix through that block becomes a cache point (``ChatInput.cache_points``) which the server
pins for its ``ttl`` (``5m`` by default, or ``1h``); a tool's point is the end of the first
turn, where chat templates render the tools. More than four points is a 400 as in Anthropic's
API; TTLs in any order are taken (each prefix for its own); with pins off it is advice.

Refused with a 400: ``thinking`` forced on (``enabled``), image and document blocks (this
server's models read text), a final assistant turn (prefill), context edits other than
clearing thinking, ``max_tokens`` below 1. Server tools and Anthropic-defined tools (a
``type`` other than ``custom``) are left out, and the response says so in a warning header.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from radixserve.api.body import STRICT, Body, build_params
from radixserve.api.chat_input import MAX_CACHE_POINTS, CachePoint, ChatInput
from radixserve.api.constraints import schema_grammar
from radixserve.api.errors import ApiError
from radixserve.api.tools import ToolPlan

BILLING_BLOCK = "x-anthropic-billing-header:"


class CacheControl(BaseModel):
    model_config = STRICT
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(BaseModel):
    model_config = STRICT
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class MediaBlock(BaseModel):
    """An image or a document: parsed so that the 400 can say why it is refused."""

    model_config = STRICT
    type: Literal["image", "document"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | MediaBlock,
    Field(discriminator="type"),
]


class Message(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = STRICT
    type: Literal["adaptive", "enabled", "disabled"]
    budget_tokens: int | None = None
    # how the client shows thinking (``updates``: Claude Code 2.1.3xx); there is none to show
    display: Literal["summarized", "omitted", "updates"] | None = None


class OutputFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = STRICT
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class ContextManagement(BaseModel):
    model_config = STRICT
    edits: list[dict[str, Any]] = []


class Metadata(BaseModel):
    model_config = STRICT
    user_id: str | None = None


class MessagesBase(Body):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    cache_control: CacheControl | None = None

    def chat_input(self, defaults: dict[str, Any], fields: dict[str, Any] | None = None):
        """The request as a ``ChatInput``; ``fields``: the sampling fields (None for
        count_tokens, which samples nothing)."""
        self._check_advice()
        messages, points = self._conversation()
        plan, notes = self._tool_plan()
        # the chat template puts the tools in the first turn (with the system prompt)
        points[:0] = [CachePoint(0, c.ttl) for c in self._tool_cache_controls()]
        if self.cache_control is not None:  # automatic: the last cacheable block
            points.append(CachePoint(len(messages) - 1, self.cache_control.ttl))
        check_cache_points(points)
        fmt = self.output_config.format if self.output_config else None
        where = "output_config.format.schema"
        grammar = schema_grammar(fmt.schema_, where, "output_config") if fmt else None
        params = [build_params(fields or {}, defaults)]
        return ChatInput.build(
            messages,
            plan,
            grammar,
            params,
            salt=self.cache_salt,
            fit_max_tokens=True,
            cache_points=tuple(points),
            notes=tuple(notes),
        )

    def _check_advice(self) -> None:
        if self.thinking is not None and self.thinking.type == "enabled":
            raise ApiError(
                400,
                "thinking cannot be enabled: this model does not think; send "
                'thinking {"type": "adaptive"} or {"type": "disabled"}, or '
                "leave it out",
                "thinking",
            )
        for edit in self.context_management.edits if self.context_management else []:
            kind = edit.get("type")
            if not (isinstance(kind, str) and kind.startswith("clear_thinking_")):
                raise ApiError(
                    400,
                    f"context_management edit {kind!r} is not supported "
                    "(only clearing thinking, of which there is none)",
                    "context_management",
                )

    def _conversation(self) -> tuple[list[dict[str, Any]], list[CachePoint]]:
        out: list[dict[str, Any]] = []
        points: list[CachePoint] = []
        system = (
            [TextBlock(type="text", text=self.system)]
            if isinstance(self.system, str)
            else (self.system or [])
        )
        kept = [b for b in system if not b.text.startswith(BILLING_BLOCK)]
        if kept:
            out.append({"role": "system", "content": "\n\n".join(b.text for b in kept)})
            points += [CachePoint(0, b.cache_control.ttl) for b in kept if b.cache_control]
        for i, m in enumerate(self.messages):
            blocks = (
                [TextBlock(type="text", text=m.content)]
                if isinstance(m.content, str)
                else (m.content)
            )
            for msg, point in _turn(m.role, blocks, f"messages[{i}]"):
                out.append(msg)
                if point is not None:
                    points.append(CachePoint(len(out) - 1, point))
        if out and out[-1]["role"] == "assistant":
            raise ApiError(
                400,
                "the last message is an assistant turn (prefill), which this "
                "server does not continue; end with a user turn",
                "messages",
            )
        return out, points

    def _tool_cache_controls(self) -> list[CacheControl]:
        return [
            CacheControl.model_validate(t["cache_control"])
            for t in self.tools or []
            if isinstance(t, dict) and t.get("cache_control") is not None
        ]

    def _tool_plan(self) -> tuple[ToolPlan | None, list[str]]:
        functions, notes = [], []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                notes.append(
                    f"tool {tool.get('name', i)!r} of type {kind!r} is not available "
                    "on this server and was left out"
                )
                continue
            function = _function(tool, i)
            if tool.get("defer_loading") is True:
                # not loaded into the prompt until a tool search finds it (the client's own,
                # as Claude Code's ToolSearch, which returns the definition in a tool result)
                continue
            functions.append(function)
        choice = self.tool_choice or ToolChoice(type="auto")
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, "tool_choice of type 'tool' needs the tool's name", "tool_choice")
        openai_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or (
            {"type": "function", "function": {"name": choice.name}}
        )
        parallel = not choice.disable_parallel_tool_use
        return ToolPlan.build(functions or None, openai_choice, parallel), notes


def check_cache_points(points: list[CachePoint]) -> None:
    """At most four breakpoints, as in Anthropic's API. Their order of time to live is not
    checked (Anthropic's wants 1h ones first): each prefix is pinned for its own."""
    if len(points) > MAX_CACHE_POINTS:
        raise ApiError(
            400,
            f"A maximum of {MAX_CACHE_POINTS} blocks with cache_control may be provided. "
            f"Found {len(points)}.",
        )


class MessagesRequest(MessagesBase):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    def to_chat_input(self, defaults: dict[str, Any]) -> ChatInput:
        if self.max_tokens < 1:
            raise ApiError(400, "max_tokens must be at least 1", "max_tokens")
        fields = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
        }
        return self.chat_input(defaults, fields)


class CountTokensRequest(MessagesBase):
    def to_chat_input(self, defaults: dict[str, Any]) -> ChatInput:
        return self.chat_input(defaults)


_TOOL_FIELDS = {
    "type",
    "name",
    "description",
    "input_schema",
    "cache_control",
    "strict",
    "eager_input_streaming",
    "input_examples",
    "defer_loading",
}


def _function(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A custom tool as a chat completions function (400 naming what is wrong)."""
    name = tool.get("name")
    where = f"tools[{i}]" + (f" ({name})" if isinstance(name, str) else "")
    unknown = sorted(set(tool) - _TOOL_FIELDS)
    if unknown:
        raise ApiError(400, f"{where}: unsupported field {unknown[0]!r}", "tools")
    schema = tool.get("input_schema")
    if not isinstance(name, str) or not name or not isinstance(schema, dict):
        raise ApiError(400, f"{where} needs a name and an input_schema object", "tools")
    if tool.get("cache_control") is not None:
        CacheControl.model_validate(tool["cache_control"])
    if not isinstance(tool.get("defer_loading", False), bool):
        raise ApiError(400, f"{where}: defer_loading must be a boolean", "tools")
    description = tool.get("description", "")
    examples = tool.get("input_examples")
    if examples:  # shown to the model as the API shows them: inside the tool's description
        description += "\nExamples of input: " + "; ".join(json.dumps(e) for e in examples)
    if not isinstance(description, str):
        raise ApiError(400, f"{where}: description must be a string", "tools")
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


def _result_text(block: ToolResultBlock) -> str:
    text = (
        block.content
        if isinstance(block.content, str)
        else ("\n".join(b.text for b in block.content))
    )
    return f"Error: {text}" if block.is_error else text


def _turn(role: str, blocks: list, where: str):
    """The chat messages of one Messages turn, each with its cache point's TTL (or None)."""
    if role == "system":
        texts = [b for b in blocks if isinstance(b, TextBlock)]
        if len(texts) != len(blocks):
            raise ApiError(400, f"{where}: a system message holds text blocks only", "messages")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    ttl: str | None = None
    out = []
    for j, b in enumerate(blocks):
        if isinstance(b, MediaBlock):
            raise ApiError(
                400,
                f"{where}.content[{j}]: {b.type} blocks are not supported: "
                "this model reads text only",
                "messages",
            )
        if isinstance(b, ThinkingBlock):
            continue  # another model's reasoning; this one has none to continue
        if isinstance(b, ToolResultBlock):
            if role != "user":
                raise ApiError(400, f"{where}: tool_result blocks belong in user turns", "messages")
            out.append(
                (
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)},
                    b.cache_control and b.cache_control.ttl,
                )
            )
            continue
        if isinstance(b, ToolUseBlock):
            if role != "assistant":
                raise ApiError(
                    400, f"{where}: tool_use blocks belong in assistant turns", "messages"
                )
            calls.append(
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
            )
        else:
            text.append(b.text)
        ttl = b.cache_control.ttl if b.cache_control else ttl
    if text or calls or not out:
        msg: dict[str, Any] = {"role": role, "content": "\n\n".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append((msg, ttl))
    return out
