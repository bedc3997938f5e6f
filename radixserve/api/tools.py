"""Tool calling: OpenAI ``tools`` rendered into the prompt and parsed back into ``tool_calls``.

A model whose chat template has a tools section (Qwen2.5's) gets the tools through the
template (``tools=`` of ``apply_chat_template``) and the history's tool calls as the template
expects them. A template without one (SmolLM2's) gets them in a system message in a
generic format, and the history's calls as text. Either way a call in the output is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Qwen/Hermes convention),
one block per call.

``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` parses whatever calls
the model writes; ``required`` and a named function constrain the output with a JSON Schema
built from the tools' parameter schemas, so the output is the call itself (a JSON object, or
with ``parallel_tool_calls`` an array of them) and always parses. Then a parameter schema
with a construct the grammar would not enforce (``schema_support``) is a 400 naming its path
(``tools[0].function.parameters...``); with ``auto`` the schema only goes into the prompt.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.api.constraints import unsupported_error
from radixserve.api.errors import ApiError
from radixserve.api.tool_stream import CLOSE, OPEN, Call, Text, ToolStream
from radixserve.structured import UnsupportedSchema, check_grammar

GENERIC_HEADER = (
    "You can call the functions below. Each is given as JSON: its name, description and a "
    "JSON Schema of its arguments.\n"
)
GENERIC_FOOTER = (
    f'\nTo call a function, answer with {OPEN}{{"name": <name>, "arguments": <arguments '
    f"object>}}{CLOSE}, one block per call."
)


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The function definitions of ``tools`` (400 naming the tool that is not valid)."""
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        name = name if isinstance(name, str) else None
        where = f"tools[{i}]" + (f" ({name})" if name else "")
        if not isinstance(tool, dict) or tool.get("type") != "function" or not name:
            raise ApiError(400, f"{where} must be {{'type': 'function', 'function': "
                           "{'name': ..., 'parameters': ...}}", "tools")  # fmt: skip
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ApiError(400, f"{where}: parameters must be a JSON Schema object", "tools")
        try:
            check_grammar("json_schema", json.dumps(params))
        except UnsupportedSchema:
            pass  # matters only when the call is constrained (``ToolPlan.build``)
        except ValueError as e:
            raise ApiError(400, f"{where}: parameters are not a usable JSON Schema: {e}",
                           "tools") from e  # fmt: skip
        functions.append({"name": name, "description": fn.get("description", ""),
                          "parameters": params})  # fmt: skip
    return functions


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its output."""

    functions: list[dict[str, Any]]
    grammar: tuple[str, str] | None  # with required or a named function
    parallel: bool

    @classmethod
    def build(cls, tools: list[Any] | None, choice: Any, parallel: bool | None) -> ToolPlan | None:
        if not tools:
            if choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools", "tool_choice")
            return None
        functions = check_tools(tools)
        if choice == "none":
            return None
        parallel = True if parallel is None else parallel
        if choice in (None, "auto"):
            return cls(functions, None, parallel)
        if choice == "required":
            chosen = functions
        elif isinstance(choice, dict) and choice.get("type") == "function":
            name = (choice.get("function") or {}).get("name")
            chosen = [f for f in functions if f["name"] == name]
            if not chosen:
                raise ApiError(400, f"tool_choice names {name!r}, which is not in tools",
                               "tool_choice")  # fmt: skip
        else:
            raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}",
                           "tool_choice")  # fmt: skip
        for f in chosen:
            i = functions.index(f)
            try:
                check_grammar("json_schema", json.dumps(f["parameters"]))
            except UnsupportedSchema as e:
                where = f"tools[{i}].function.parameters"
                raise unsupported_error(e, where, "tools") from e
        return cls(functions, ("json_schema", json.dumps(_calls_schema(chosen, parallel))),
                   parallel)  # fmt: skip

    def render(self, conversation: list[dict[str, Any]], template_has_tools: bool):
        """The conversation and the ``tools`` argument for the chat template."""
        if template_has_tools:
            tools = [{"type": "function", "function": f} for f in self.functions]
            return conversation, tools
        listing = "\n".join(json.dumps(f) for f in self.functions)
        system = GENERIC_HEADER + listing + GENERIC_FOOTER
        if conversation and conversation[0]["role"] == "system":
            first = conversation[0]
            merged = {**first, "content": first["content"] + "\n\n" + system}
            return [merged, *conversation[1:]], None
        return [{"role": "system", "content": system}, *conversation], None

    def stream(self) -> ToolStream:
        """A parser of this request's output into text and calls (``tool_stream.py``)."""
        names = frozenset(f["name"] for f in self.functions)
        return ToolStream(names, self.grammar is not None, self.parallel)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The content left and the tool calls (OpenAI's shape) in one whole output."""
        parser = self.stream()
        pieces = parser.feed(text) + parser.finish()
        calls = [openai_call(p) for p in pieces if isinstance(p, Call)]
        if not calls:
            return text, []
        content = "".join(p.text for p in pieces if isinstance(p, Text))
        return content or None, calls


def history_message(message: dict[str, Any], template_has_tools: bool) -> dict[str, Any]:
    """An assistant message with ``tool_calls`` as the chat template takes it."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, "an assistant tool call needs function.name", "messages")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError) as e:
            raise ApiError(400, "a tool call's arguments must be a JSON string",
                           "messages") from e  # fmt: skip
        calls.append({"name": fn["name"], "arguments": args})
    if template_has_tools:
        return {**message, "tool_calls": [{"type": "function", "function": c} for c in calls]}
    text = "".join(f"{OPEN}{json.dumps(c)}{CLOSE}" for c in calls)
    return {"role": "assistant", "content": (message.get("content") or "") + text}


def call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def openai_call(call: Call) -> dict[str, Any]:
    """A parsed call in chat completions' ``tool_calls`` shape, with a fresh id."""
    return {"id": call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#``, ``#/...``) pointing below ``base`` instead
    of its own root, so it keeps its meaning once placed there inside a larger schema."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def _calls_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """One call (or a list of calls) of ``functions``. Each function's parameters sit in the
    root's ``$defs``, their local references rebased, so ``#/$defs/...`` in a tool's own
    parameters still resolves inside the combined schema."""
    defs = {f"tool{i}": _rebased(f["parameters"], f"#/$defs/tool{i}")
            for i, f in enumerate(functions)}  # fmt: skip
    one = [
        {"type": "object", "properties": {"name": {"const": f["name"]},
                                          "arguments": {"$ref": f"#/$defs/tool{i}"}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for i, f in enumerate(functions)
    ]  # fmt: skip
    call = one[0] if len(one) == 1 else {"anyOf": one}
    if parallel:
        call = {"type": "array", "items": call, "minItems": 1}
    return {**call, "$defs": defs}
