"""The output's JSON read byte by byte, as far as distinct items (``uniqueItems``) need it.

``Tracker(plan)`` follows the text a constrained request writes (the grammar guarantees it
is JSON, written as the grammar engines write it) with a stack of open objects and arrays,
each with its state in the ``UniquePlan``. Inside an array whose items must be distinct
(its ``ItemRule``), it keeps the items written so far (as ``value_key``s: equal JSON values,
such as ``1`` and ``1.0`` or two objects with their keys in another order, have one key)
and the text of the item being written. ``feed(data)`` moves over a token's bytes and says
False where they break the rule: they complete an item equal to an earlier one, or leave an
item that can only end equal to one (a listed value no longer the start of an unused one, a
literal already written, a record whose string would close on an earlier record). The
caller (``unique_matcher``) tries candidate tokens on a copy (``snapshot``/``restore``) and
bans those; a token it feeds for real never breaks it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixserve.structured.schema_types import value_key
from radixserve.structured.unique_plan import ANY, ItemRule, UniquePlan

OBJ, ARR = 0, 1  # frame kinds
KEY, COLON, VALUE, NEXT = 0, 1, 2, 3  # what a frame expects next
TEXT, STRING, SCALAR = 0, 1, 2  # lexer modes
_SPECIAL = re.compile(rb'["\\]')
_LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}
_KIND = {ord("t"): "boolean", ord("f"): "boolean", ord("n"): "null"}
_ENDS_SCALAR = frozenset(b",]}: \t\r\n")


class Tracker:
    """One request's position in its output's JSON (see the module docstring)."""

    __slots__ = ("plan", "stack", "mode", "sbuf", "esc", "is_key", "active", "rule", "used",
                 "used_text", "item", "_listed_keys")  # fmt: skip

    def __init__(self, plan: UniquePlan):
        self.plan = plan
        # frames: (kind, state, key or index, expects)
        self.stack: tuple[tuple[int, int, Any, int], ...] = ()
        self.mode, self.sbuf, self.esc, self.is_key = TEXT, b"", 0, False
        self.active = -1  # the stack index of the array whose items must be distinct
        self.rule: ItemRule | None = None
        self.used: frozenset[str] = frozenset()  # value_keys of its items so far
        self.used_text: tuple[Any, ...] = ()  # its items so far, as values
        self.item: bytes | None = None  # the text of its item being written
        self._listed_keys: dict[bytes, str] = {}

    def snapshot(self) -> tuple:
        return (self.stack, self.mode, self.sbuf, self.esc, self.is_key, self.active,
                self.rule, self.used, self.used_text, self.item)  # fmt: skip

    def restore(self, snap: tuple) -> None:
        (self.stack, self.mode, self.sbuf, self.esc, self.is_key, self.active, self.rule,
         self.used, self.used_text, self.item) = snap  # fmt: skip

    @property
    def at_risk(self) -> bool:
        """Whether a token could break the rule now (inside an array whose items must be
        distinct: one token may complete an item and write it again)."""
        return self.active >= 0

    def feed(self, data: bytes) -> bool:
        """Move over ``data``; False where it breaks the rule (the state is then undefined:
        restore a snapshot)."""
        try:
            i, n = 0, len(data)
            while i < n:
                if self.mode == STRING:
                    i = self._string(data, i)
                    if i < 0:
                        return False
                    continue
                c = data[i]
                i += 1
                if self.mode == SCALAR:
                    if c not in _ENDS_SCALAR:
                        self._add(c)
                        continue
                    self.mode = TEXT
                    if not self._done():
                        return False
                if not self._structure(c):
                    return False
            return self._live()
        except (ValueError, UnicodeDecodeError):
            return False  # not JSON as far as it goes: never written, so never allowed

    # -- bytes -----------------------------------------------------------------------------

    def _add(self, c: int) -> None:
        if self.item is not None:
            self.item += bytes((c,))

    def _string(self, data: bytes, i: int) -> int:
        """Consume string bytes from ``i``; the next index, or -1 where the rule breaks."""
        if self.esc:
            c = data[i]
            self.esc = (2 if c == ord("u") else 0) if self.esc == 1 else (self.esc + 1) % 6
            self.sbuf += data[i : i + 1]
            self._add(c)
            return i + 1
        found = _SPECIAL.search(data, i)
        j = found.start() if found else len(data)
        if j > i:
            self.sbuf += data[i:j]
            if self.item is not None:
                self.item += data[i:j]
            return j
        self._add(data[i])
        if data[i] == ord("\\"):
            self.esc = 1
            self.sbuf += b"\\"
            return i + 1
        self.mode = TEXT
        if self.is_key:
            key = json.loads(b'"' + self.sbuf + b'"')
            kind, state, _, _ = self.stack[-1]
            self.stack = (*self.stack[:-1], (kind, state, key, COLON))
            return i + 1
        return i + 1 if self._done(string=True) else -1

    def _structure(self, c: int) -> bool:
        if c in b" \t\r\n":
            return True
        if c == ord('"'):
            if self.stack and self.stack[-1][0] == OBJ and self.stack[-1][3] == KEY:
                self.mode, self.sbuf, self.esc, self.is_key = STRING, b"", 0, True
                self._add(c)
                return True
            self._begin("string")
            self.mode, self.sbuf, self.esc, self.is_key = STRING, b"", 0, False
            self._add(c)
            return True
        if c in b"{[":
            state = self._begin("object" if c == ord("{") else "array")
            self._add(c)
            if c == ord("{"):
                self.stack = (*self.stack, (OBJ, state, None, KEY))
            else:
                self.stack = (*self.stack, (ARR, state, 0, VALUE))
                rule = self.plan.rule(state) if self.active < 0 else None
                if rule is not None:
                    self.active, self.rule = len(self.stack) - 1, rule
                    self.used, self.used_text = frozenset(), ()
            return True
        if c in b"}]":
            self._add(c)
            if self.active == len(self.stack) - 1:
                self.active, self.rule, self.used, self.used_text = -1, None, frozenset(), ()
            self.stack = self.stack[:-1]
            return self._done()
        if c in b",:":
            kind, state, slot, _ = self.stack[-1]
            if c == ord(":"):
                self.stack = (*self.stack[:-1], (kind, state, slot, VALUE))
            elif kind == OBJ:
                self.stack = (*self.stack[:-1], (kind, state, None, KEY))
            else:
                self.stack = (*self.stack[:-1], (kind, state, slot + 1, VALUE))
            self._add(c)
            return True
        kind = _KIND.get(c, "number")
        self._begin(kind)
        self.mode = SCALAR
        self._add(c)
        return True

    # -- values ----------------------------------------------------------------------------

    def _begin(self, kind: str) -> int:
        """A value of ``kind`` starts: its state, and the start of an item."""
        depth = len(self.stack)
        if self.active >= 0 and depth - 1 == self.active:
            self.item = b""
        if self.active >= 0 or not self.stack:
            place = self.plan.root if not self.stack else ANY
        else:
            frame, state, slot, _ = self.stack[-1]
            place = (self.plan.member(state, slot) if frame == OBJ
                     else self.plan.item(state, slot))  # fmt: skip
        return self.plan.value(place, kind)

    def _done(self, string: bool = False) -> bool:
        """The value just written (a string, a scalar, an object or array) is complete."""
        depth = len(self.stack)
        if depth and depth - 1 == self.active and self.item is not None:
            value = json.loads(self.item)
            key = value_key(value)
            if key in self.used:
                return False
            self.used, self.used_text = self.used | {key}, (*self.used_text, value)
            self.item = None
        elif string and self.rule is not None and self.rule.kind == "record":
            if depth - 2 == self.active and self.item is not None:  # a record's string
                if value_key(json.loads(self.item + b"}")) in self.used:
                    return False
        if depth:
            kind, state, slot, _ = self.stack[-1]
            self.stack = (*self.stack[:-1], (kind, state, slot, NEXT))
        return True

    def _live(self) -> bool:
        """Whether the item being written can still end unlike every earlier one."""
        rule = self.rule
        if rule is None or not self.used:
            return True  # nothing written yet, so nothing to repeat
        if rule.kind == "listed":
            if self.item is None:
                _, _, index, expects = self.stack[self.active]
                return not (expects == VALUE and index > 0) or len(self.used) < len(rule.texts)
            return any(t.startswith(self.item) and self._listed_key(t) not in self.used
                       for t in rule.texts)  # fmt: skip
        if self.item and self.mode == SCALAR and self.item[0] in _LITERALS:
            literal = _LITERALS[self.item[0]]
            repeated = value_key(json.loads(literal)) in self.used
            return not (literal.startswith(self.item) and repeated)
        return True

    def _listed_key(self, text: bytes) -> str:
        found = self._listed_keys.get(text)
        if found is None:
            found = self._listed_keys[text] = value_key(json.loads(text))
        return found

    # -- for the candidates of a ban (``unique_matcher``) ------------------------------------

    @property
    def in_string(self) -> bool:
        return self.mode == STRING

    def in_item_string(self) -> bool:
        """In a string that is itself an item (not a string inside an item)."""
        return self.mode == STRING and len(self.stack) - 1 == self.active

    def remainders(self) -> tuple[list[bytes], bool]:
        """Where the string being written is the start of an earlier item's text (an item
        string, or a record's property value): the rest of that text, unescaped; and
        whether closing the string there surely repeats an item (it is an item itself)."""
        if self.mode != STRING or self.esc or b"\\" in self.sbuf or self.is_key:
            return [], False
        out = []
        item = len(self.stack) - 1 == self.active
        if item:
            for v in self.used_text:
                if isinstance(v, str):
                    b = v.encode("utf-8", "surrogatepass")
                    if b.startswith(self.sbuf):
                        out.append(b[len(self.sbuf) :])
        elif len(self.stack) - 2 == self.active and self.rule and self.rule.kind == "record":
            key = self.stack[-1][2]
            for v in self.used_text:
                s = v.get(key) if isinstance(v, dict) else None
                b = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else None
                if b is not None and b.startswith(self.sbuf):
                    out.append(b[len(self.sbuf) :])
        return out, item

    @property
    def escaped(self) -> bool:
        """The string being written holds an escape (its unescaped text is not its bytes)."""
        return self.mode == STRING and (bool(self.esc) or b"\\" in self.sbuf)
