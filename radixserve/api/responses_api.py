"""The OpenAI Responses API's request body (``POST /v1/responses``), turned into a
``ChatInput`` (``chat_input.py``) after the conversation of ``previous_response_id``.

Honoured: ``input`` as a string or items (messages with ``input_text`` / ``output_text``
parts, ``function_call``, ``function_call_output``: the output of a call, or one given
unasked, with a ``name`` and no ``call_id``), ``instructions``, ``function`` tools and
``namespace`` tools (groups of functions: flattened, and a call names its namespace),
``tool_choice`` (``auto``, ``none``, ``required``, a named function), ``parallel_tool_calls``,
``max_output_tokens`` (lowered to the context left after the prompt), ``temperature``,
``top_p``, ``text.format`` (``json_schema`` or ``json_object``: the output is constrained to
it), ``store`` and ``previous_response_id`` (the server's store, ``server/response_store.py``),
``metadata`` (echoed), ``prompt_cache_key`` (a fleet router's affinity key).

Accepted as advice: ``reasoning`` (this model does not reason; ``include`` may ask for
``reasoning.encrypted_content``, of which there is none), ``text.verbosity``,
``client_metadata``, ``user``, ``safety_identifier``, ``service_tier``,
``prompt_cache_retention``, ``stream_options``; ``reasoning`` items in the input are dropped
(another model's). Refused with a 400: image, file and audio parts (this server's models read
text), other item types, ``truncation: auto``, ``background``, ``top_logprobs``,
``max_tool_calls``, other ``include`` values. Hosted tools (``web_search``, ``file_search``,
...) are left out and the response says so in a warning header.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from radixserve.api.body import STRICT, Body, CachePin, build_params
from radixserve.api.chat_input import ChatInput
from radixserve.api.constraints import grammar_from, schema_grammar
from radixserve.api.errors import ApiError
from radixserve.api.tools import ToolPlan

INCLUDABLE = ("reasoning.encrypted_content",)  # there is no reasoning: nothing to include
_TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(BaseModel):
    model_config = STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: bool | None = None


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    client_metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    background: bool = False
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    cache_pin: CachePin | None = None  # extension: pin the prompt's prefix (body.py)

    def to_chat_input(
        self, defaults: dict[str, Any], history: list[dict[str, Any]]
    ) -> tuple[ChatInput, dict[str, str]]:
        """The request as a ``ChatInput`` after ``history`` (the previous response's
        conversation), and the namespace of each namespaced function."""
        self._refuse()
        messages = list(history)
        messages += input_messages(self.input)
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        functions, namespaces, notes = flatten_tools(self.tools or [])
        parallel = self.parallel_tool_calls
        plan = ToolPlan.build(functions or None, _choice(self.tool_choice), parallel)
        fields = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        params = [build_params(fields, defaults)]
        points = self.cache_pin.points(len(messages)) if self.cache_pin else ()
        chat = ChatInput.build(
            messages,
            plan,
            self._grammar(),
            params,
            param="input",
            salt=self.cache_salt,
            fit_max_tokens=True,
            cache_points=points,
            pins_asked=bool(points),
            notes=tuple(notes),
        )
        return chat, namespaces

    def _refuse(self) -> None:
        refused = {
            "truncation": self.truncation == "auto",
            "background": self.background,
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
        }
        for name, bad in refused.items():
            if bad:
                raise ApiError(400, f"{name} is not supported by this server", name)
        for value in self.include or []:
            if value not in INCLUDABLE:
                raise ApiError(
                    400,
                    f"include {value!r} is not supported; this server can "
                    f"include {', '.join(INCLUDABLE)}",
                    "include",
                )

    def _grammar(self) -> tuple[str, str] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return grammar_from({"json_object": True})
        return schema_grammar(fmt.schema_, "text.format.schema", "text")


def _choice(choice: str | dict[str, Any] | None) -> Any:
    """``tool_choice`` in chat completions' form."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        "tool_choice",
    )


def flatten_tools(tools: list[Any]) -> tuple[list[dict], dict[str, str], list[str]]:
    """Function definitions in chat completions' form (namespaces flattened), the namespace
    of each namespaced function, and notes on the tools left out."""
    functions: list[dict] = []
    namespaces: dict[str, str] = {}
    notes: list[str] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            functions.append(_function(tool, f"tools[{i}]"))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for j, inner in enumerate(tool["tools"]):
                fn = _function(inner, f"tools[{i}].tools[{j}]")
                functions.append(fn)
                namespaces[fn["function"]["name"]] = str(tool.get("name", ""))
        elif isinstance(kind, str):
            notes.append(f"tool type {kind!r} is not available on this server and was left out")
        else:
            raise ApiError(400, f"tools[{i}] needs a type", "tools")
    names = [f["function"]["name"] for f in functions]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ApiError(400, f"tool name {twice[0]!r} is given more than once", "tools")
    return functions, namespaces, notes


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f"{where}: a namespace holds function tools only", "tools")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where} needs a name", "tools")
    if not isinstance(tool.get("description", ""), str | None):
        raise ApiError(400, f"{where}: description must be a string", "tools")
    fn = {
        "name": name,
        "description": tool.get("description") or "",
        "parameters": tool.get("parameters") or {"type": "object"},
    }
    return {"type": "function", "function": fn}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages; consecutive function calls join one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_output(item, where))
        elif kind != "reasoning":  # another model's reasoning: dropped
            raise ApiError(400, f"{where}: item type {kind!r} is not supported", "input")
    return out


def _output(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool result: the output of a call (``call_id``), or one the client gives unasked,
    named instead (Codex's ``goal_objective`` after it sets a goal)."""
    call_id, name, output = item.get("call_id"), item.get("name"), item.get("output")
    if not isinstance(call_id, str) and not isinstance(name, str):
        raise ApiError(400, f"{where} needs a call_id (or, unasked for, a name)", "input")
    text = output if isinstance(output, str) else _parts_text(output, where)
    if isinstance(call_id, str):
        return {"role": "tool", "tool_call_id": call_id, "content": text}
    return {"role": "tool", "name": name, "content": text}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(400, f"{where}: role must be user, assistant, system or developer", "input")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, where)
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise ApiError(400, f"{where}: content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(
                400,
                f"{where}.content[{j}]: {kind} parts are not supported: this model reads text only",
                "input",
            )
        else:
            raise ApiError(
                400, f"{where}.content[{j}]: part type {kind!r} is not supported", "input"
            )
    return "".join(texts)


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
        raise ApiError(
            400,
            f"{where}: a function_call needs call_id, name and arguments (a JSON string)",
            "input",
        )
    try:
        json.loads(args)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{where}: arguments are not JSON: {e}", "input") from e
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
