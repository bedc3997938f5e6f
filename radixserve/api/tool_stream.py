"""A model's output, as it arrives, split into text and tool calls: the one parser under the
three APIs (chat completions, Messages, Responses), streamed or not.

With ``tool_choice: auto`` a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the Qwen/Hermes convention ``tools.py`` renders), and text before, between and after calls
streams as it comes, holding back only what could be the start of ``<tool_call>``. Small
models often answer with the call and no tags, as a bare JSON object or in a ```` ```json````
fence: in an output that starts with a JSON object, each top-level object naming a tool in the
request is a call too (other objects and text stay text), so a tool loop gets a call and not
a call dressed as text.
A block that does not parse as a call (malformed JSON, no name) falls back to text, never an
error. Under a grammar
(``required``, a named tool) the output is the call itself (one JSON object, or an array with
parallel calls), parsed when it ends; cut short by ``max_tokens`` it is text.

Whitespace around calls is dropped, and with ``parallel`` off only the first call counts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text


Piece = Text | Call


def as_call(value: Any, names: frozenset[str] | None = None) -> Call | None:
    """The call a parsed JSON value is (``{"name", "arguments"}``; ``parameters`` is taken for
    ``arguments``, and arguments given as a JSON string are read), or None. ``names``: only
    calls of these tools count."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and (
        value["name"] not in names or set(value) - {"name", "arguments", "parameters"}
    ):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(value["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


class ToolStream:
    """Feed text deltas, get ``Text`` and ``Call`` pieces; ``finish`` flushes the rest."""

    def __init__(self, names: frozenset[str], constrained: bool, parallel: bool):
        self.names, self.constrained, self.parallel = names, constrained, parallel
        self.buf = ""  # text not yet given out
        self.in_call = False  # inside <tool_call> ... </tool_call>
        self.started = False  # something other than whitespace came
        self.bare = False  # the output may be one bare call: held until it ends
        self.pending_space = ""  # whitespace held until we know it is not before a call
        self.after_call = False  # whitespace after a call is dropped
        self.calls = 0

    def feed(self, delta: str) -> list[Piece]:
        self.buf += delta
        if self.constrained:
            return []
        out: list[Piece] = []
        if not self.started:
            stripped = self.buf.lstrip()
            if not stripped:
                self.buf = ""
                return out
            self.started, self.buf = True, stripped
            self.bare = stripped[0] == "{" or stripped.startswith("`")
        if self.bare:  # held whole until it ends, unless it can no longer be a lone call
            if self._maybe_bare(self.buf):
                return out
            self.bare = False
        while True:
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                out += self._call_block(self.buf[:end], OPEN + self.buf[: end + len(CLOSE)])
                self.buf, self.in_call = self.buf[end + len(CLOSE) :], False
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                out += self._text(self.buf[:start], final=True)
                self.buf, self.in_call = self.buf[start + len(OPEN) :], True
                continue
            keep = _partial_suffix(self.buf, OPEN)
            out += self._text(self.buf[: len(self.buf) - keep], final=False)
            self.buf = self.buf[len(self.buf) - keep :]
            return out

    def finish(self) -> list[Piece]:
        """The pieces the rest of the output makes, once it ended."""
        if self.constrained:
            text, self.buf = self.buf, ""
            value = _loads(text)
            values = value if isinstance(value, list) else [value]
            calls = [as_call(v) for v in values]
            if value is None or not values or None in calls:
                return [Text(text)] if text else []  # cut short by max_tokens
            return calls[: None if self.parallel else 1]
        out: list[Piece] = []
        if self.bare:
            pieces = self._bare_calls(self.buf)
            if pieces is not None:
                self.buf = ""
                return pieces
            self.bare = False
            out = self.feed("")
        text, self.buf = self.buf, ""
        if self.in_call:  # ended inside a block (no closing tag): a call if it parses
            return out + self._call_block(text, OPEN + text)
        return out + self._text(text, final=True)

    def _maybe_bare(self, text: str) -> bool:
        """Could ``text`` still grow into one bare call (an object, or one in a fence)?"""
        if text.startswith("{"):
            return True
        return any(text[: len(c)] == c[: len(text)] for c in ("```json", "```\n{"))

    def _bare_calls(self, text: str) -> list[Piece] | None:
        """The pieces of an output of bare JSON objects (or one in a fence), if some of them
        are calls of known tools: a small model may write a call after echoing the tool's
        last result, or go on to imagine the next one."""
        text = text.strip()
        fenced = _FENCE.match(text)
        call = as_call(_loads(fenced.group(1)), self.names) if fenced else None
        if call is not None:
            return [call]
        out: list[Piece] = []
        pos, decoder = 0, json.JSONDecoder()
        while pos < len(text):
            try:
                value, end = decoder.raw_decode(text, pos)
            except (json.JSONDecodeError, RecursionError):
                out.append(Text(text[pos:]))
                break
            call = as_call(value, self.names)
            if call is None:
                out.append(Text(text[pos:end]))
            elif self.parallel or not self.calls:
                self.calls += 1
                out.append(call)
            pos = end + len(text[end:]) - len(text[end:].lstrip())
        return out if self.calls else None

    def _call_block(self, body: str, raw: str) -> list[Piece]:
        call = as_call(_loads(body.strip()))
        if call is None:
            return self._text(raw, final=False)  # malformed: the block stays text
        self.pending_space, self.after_call = "", True
        self.calls += 1
        return [call] if self.parallel or self.calls == 1 else []

    def _text(self, text: str, final: bool) -> list[Piece]:
        """Text to give out; whitespace at its end is held (a call may follow: ``final``
        says one does, or the output ended), and dropped at the start after a call."""
        text = self.pending_space + text
        if self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        self.pending_space = "" if final else text[len(body) :]
        if not body:
            return []
        self.after_call = False
        return [Text(body)]


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of ``text`` that begins ``token`` (held back: the rest of
    the token may follow)."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
