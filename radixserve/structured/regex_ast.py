"""A JSON Schema ``pattern`` (ECMA-262 syntax, a common subset) read into a small tree and
written back, for the exact rewrites of ``regex_exclude``.

``parse(pattern)`` returns the tree or raises ``RegexUnsupported`` for what it does not read
(backreferences, ``\\b``, lookbehinds, ``\\p{...}``, flag groups, an empty class ``[]``).
Nodes are hashable tuples:

- ``("set", ranges)``: one character from sorted, disjoint ``(lo, hi)`` code point ranges
  (``.`` is every character but the line terminators, ``\\d`` is ``[0-9]``, ``\\w`` is
  ``[A-Za-z0-9_]``, as ECMA-262 defines them without the ``u`` flag's case folding);
- ``("cat", items)``, ``("alt", branches)``, ``("rep", node, low, high)`` (``high`` None
  for no bound; lazy quantifiers match the same strings);
- ``("bol",)`` / ``("eol",)`` for ``^`` / ``$``, ``("look", negative, node)`` for
  ``(?=...)`` / ``(?!...)``: zero-width, and placed as written.

``EPS`` (``cat`` of nothing) matches the empty string, ``EMPTY`` (``alt`` of nothing) nothing.
``write(node)`` is a pattern for a tree without anchors or lookaheads, using only syntax
xgrammar, llguidance and Python's ``re`` all read alike (``RegexUnsupported`` where a
character beyond U+FFFF would have to be written).
"""

from __future__ import annotations

from typing import Any

Node = tuple[Any, ...]
MAX = 0x10FFFF
EPS: Node = ("cat", ())
EMPTY: Node = ("alt", ())
_DIGIT = ((48, 57),)
_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE = ((9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
          (0xFEFF, 0xFEFF))  # fmt: skip
_LINE_ENDS = ((10, 10), (13, 13), (0x2028, 0x2029))
_CONTROL = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "0": 0}


class RegexUnsupported(ValueError):
    """A pattern construct this module does not read or cannot write."""


def complement(ranges: tuple) -> tuple:
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    return tuple(out + ([(at, MAX)] if at <= MAX else []))


def union(*sets: tuple) -> tuple:
    out: list[list[int]] = []
    for lo, hi in sorted(r for s in sets for r in s):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def intersect(a: tuple, b: tuple) -> tuple:
    return complement(union(complement(a), complement(b)))


DOT: Node = ("set", complement(_LINE_ENDS))
_CLASSES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}


def parse(pattern: str) -> Node:
    parser = _Parser(pattern)
    node = parser.alt()
    if parser.i != len(pattern):
        raise RegexUnsupported(f"unbalanced ')' at {parser.i}")
    return node


class _Parser:
    def __init__(self, p: str):
        self.p, self.i = p, 0

    def peek(self, n: int = 1) -> str:
        return self.p[self.i : self.i + n]

    def alt(self) -> Node:
        branches = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.cat())
        return branches[0] if len(branches) == 1 else ("alt", tuple(branches))

    def cat(self) -> Node:
        items = []
        while self.i < len(self.p) and self.peek() not in "|)":
            items.append(self.quantified())
        return items[0] if len(items) == 1 else ("cat", tuple(items))

    def quantified(self) -> Node:
        node = self.atom()
        c = self.peek()
        bounds = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(c)
        if bounds:
            self.i += 1
        elif c == "{":
            bounds = self.braces()
        if bounds is None:
            return node
        if node[0] in ("bol", "eol", "look"):
            raise RegexUnsupported("a quantified assertion")
        if self.peek() == "?":
            self.i += 1  # lazy: the same strings
        return ("rep", node, *bounds)

    def braces(self) -> tuple[int, int | None] | None:
        end = self.p.find("}", self.i)
        body = self.p[self.i + 1 : end] if end > 0 else ""
        low, _, high = body.partition(",")
        if not low.isdigit() or (high and not high.isdigit()):
            return None  # a literal '{'
        self.i = end + 1
        if "," not in body:
            return int(low), int(low)
        return int(low), int(high) if high else None

    def atom(self) -> Node:
        c = self.peek()
        self.i += 1
        if c == "(":
            return self.group()
        if c == "[":
            return ("set", self.klass())
        if c in "^$":
            return ("bol",) if c == "^" else ("eol",)
        if c == ".":
            return DOT
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "*+?":
            raise RegexUnsupported(f"nothing to repeat at {self.i - 1}")
        return ("set", ((ord(c), ord(c)),))

    def group(self) -> Node:
        look = None
        if self.peek(2) in ("?=", "?!"):
            look, self.i = self.peek(2) == "?!", self.i + 2
        elif self.peek(2) == "?:":
            self.i += 2
        elif self.peek(2) in ("?<", "?P") and self.peek(3) not in ("?<=", "?<!"):
            end = self.p.find(">", self.i)
            if end < 0:
                raise RegexUnsupported("an unterminated group name")
            self.i = end + 1
        elif self.peek() == "?":
            raise RegexUnsupported(f"the group ({self.peek(3)}... is not read")
        node = self.alt()
        if self.peek() != ")":
            raise RegexUnsupported("an unterminated group")
        self.i += 1
        return node if look is None else ("look", look, node)

    def klass(self) -> tuple:
        negated = self.peek() == "^"
        self.i += negated
        if self.peek() == "]":
            raise RegexUnsupported("an empty class")
        parts: list[tuple] = []
        while self.peek() != "]":
            if not self.peek():
                raise RegexUnsupported("an unterminated class")
            lo = self.class_atom()
            if self.peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_atom()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise RegexUnsupported("a range between classes")
                lo = ((lo[0][0], hi[0][0]),)
            parts.append(lo)
        self.i += 1
        ranges = union(*parts)
        return complement(ranges) if negated else ranges

    def class_atom(self) -> tuple:
        c = self.peek()
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        return ((ord(c), ord(c)),)

    def escape(self, in_class: bool) -> tuple:
        c = self.peek()
        self.i += 1
        if c.lower() in _CLASSES:
            ranges = _CLASSES[c.lower()]
            return complement(ranges) if c.isupper() else ranges
        if c in _CONTROL and not (c == "0" and self.peek().isdigit()):
            return ((_CONTROL[c], _CONTROL[c]),)
        if c == "b" and in_class:
            return ((8, 8),)
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.p[self.i : self.i + width]
            if len(digits) == width and all(d in "0123456789abcdefABCDEF" for d in digits):
                self.i += width
                return ((int(digits, 16), int(digits, 16)),)
        if not c or c.isalnum():
            raise RegexUnsupported(f"the escape \\{c} is not read")
        return ((ord(c), ord(c)),)


def write(node: Node) -> str:
    kind = node[0]
    if kind == "set":
        return _write_set(node[1])
    if kind == "cat":
        return "".join(_wrap(n, "alt") for n in node[1])
    if kind == "alt":
        if not node[1]:
            return "[^\\s\\S]"
        # the empty branch last, as (?:x|): xgrammar 0.2.9 reads some (x)? in a JSON
        # Schema pattern wrongly (^@(a@*)?$ takes "@@")
        others = [write(n) for n in node[1] if n != EPS]
        return "|".join(others + ([""] if EPS in node[1] else []))
    if kind == "rep":
        _, sub, low, high = node
        if (low, high) == (0, 1) and sub[0] != "set":
            return f"(?:{write(sub)}|)"  # not (x)?: see above
        text = _wrap(sub, "alt", "cat", "rep")
        suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((low, high))
        if suffix is None:
            suffix = f"{{{low}}}" if low == high else f"{{{low},{'' if high is None else high}}}"
        return text + suffix
    raise RegexUnsupported(f"{kind} cannot be written")


def _wrap(node: Node, *kinds: str) -> str:
    text = write(node)
    many = node[0] in kinds and (len(node[1]) != 1 if node[0] in ("cat", "alt") else True)
    return f"(?:{text})" if many or (node[0] == "cat" and not node[1]) else text


def _char(c: int) -> str:
    if c > 0xFFFF:
        raise RegexUnsupported("a character beyond U+FFFF")
    if 32 < c < 127:
        ch = chr(c)
        return "\\" + ch if ch in "\\^$.|?*+()[]{}-/" else ch
    return f"\\u{c:04x}"


def _write_set(ranges: tuple) -> str:
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0])
    if ranges == ((0, MAX),):
        return "[\\s\\S]"
    negated = bool(ranges) and ranges[-1][1] == MAX
    body = complement(ranges) if negated else ranges
    text = "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in body)
    return f"[{'^' if negated else ''}{text}]"
