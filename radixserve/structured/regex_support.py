"""Regular-expression constructs the grammar engine would drop without enforcing them.

xgrammar 0.2.9 compiles a pattern as a full match and ignores, with only a log warning,
lookaheads (``(?=...)``, ``(?!...)``) and a ``^`` or ``$`` in the middle of the pattern. A
full match makes an anchor redundant where it stands at the start (``^``) or the end
(``$``) of every way through the pattern: at its start or end, or of a top-level
alternative, or of a group that itself stands there. Anywhere else, dropping the anchor
lets through text the pattern refuses (``a^b``, ``a$b``). Constructs xgrammar refuses
outright (lookbehinds, backreferences, ``\\b``, ``\\p{...}``) are a compile error already.
"""

from __future__ import annotations

_LOOKAROUND = {"(?=": "lookahead (?=...)", "(?!": "negative lookahead (?!...)",
               "(?<=": "lookbehind (?<=...)", "(?<!": "negative lookbehind (?<!...)"}  # fmt: skip


def pattern_problem(pattern: str) -> str | None:
    """What in ``pattern`` the grammar would not enforce, or None."""
    tokens = _tokens(pattern)
    for kind, text in tokens:
        if kind == "open" and text in _LOOKAROUND:
            return f"{_LOOKAROUND[text]} is not supported"
    if not _anchors_at_edge(tokens, "^"):
        return "'^' that is not at the start of the pattern or of an alternative is not supported"
    reverse = [({"open": "close", "close": "open"}.get(k, k), t) for k, t in reversed(tokens)]
    if not _anchors_at_edge(reverse, "$"):
        return "'$' that is not at the end of the pattern or of an alternative is not supported"
    return None


def _tokens(p: str) -> list[tuple[str, str]]:
    """(kind, text): kinds open, close, alt, anchor, atom (quantifiers count as atoms)."""
    out, i = [], 0
    while i < len(p):
        c = p[i]
        if c == "\\":
            out.append(("atom", p[i : i + 2]))
            i += 2
        elif c == "[":
            j = i + 1 + (p[i + 1 : i + 2] == "^")
            j += p[j : j + 1] == "]"  # a leading ] is a literal
            while j < len(p) and p[j] != "]":
                j += 2 if p[j] == "\\" else 1
            out.append(("atom", p[i : j + 1]))
            i = j + 1
        elif c == "(":
            head = next((h for h in _LOOKAROUND if p.startswith(h, i)), None)
            end = i + len(head) if head else _group_head_end(p, i)
            if p[end - 1 : end] == ")":
                i = end  # a flag group such as (?i): matches nothing
                continue
            out.append(("open", head or p[i:end]))
            i = end
        else:
            kind = {")": "close", "|": "alt", "^": "anchor", "$": "anchor"}.get(c, "atom")
            out.append((kind, c))
            i += 1
    return out


def _group_head_end(p: str, i: int) -> int:
    """Where the body of the group opened at ``p[i]`` begins: after ``(``, ``(?:``,
    ``(?P<name>``, ``(?<name>`` or ``(?flags:``; a flag group ``(?i)`` ends at its ``)``."""
    if not p.startswith("(?", i):
        return i + 1
    stop = ">" if p.startswith(("(?<", "(?P<"), i) else ":)"
    j = i + 2
    while j < len(p) and p[j] not in stop:
        j += 1
    return j + 1


def _anchors_at_edge(tokens: list[tuple[str, str]], anchor: str) -> bool:
    """Whether every ``anchor`` stands where nothing can have been matched before it (read
    from the left; the caller reverses the tokens for ``$``)."""
    at_edge, groups = True, []  # groups: whether each open group began at the edge
    for kind, text in tokens:
        if kind == "open":
            groups.append(at_edge)
        elif kind == "close":
            if groups:
                groups.pop()
            at_edge = False
        elif kind == "alt":
            at_edge = groups[-1] if groups else True
        elif kind == "anchor":
            if text == anchor and not at_edge:
                return False
        else:
            at_edge = False
    return True


def optional_groups_spelled_out(pattern: str) -> str:
    """``pattern`` with each group made optional by ``?`` written ``{0,1}`` instead (the
    same strings): xgrammar 0.2.9 compiles some ``(...)?`` in a JSON Schema pattern into a
    grammar that takes more than the pattern (``^x(ab*)?y$`` takes ``"xby"``), and reads
    ``{0,1}`` right."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
        elif c == "[":
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(pattern[i : j + 1])
            i = j + 1
        elif c == ")" and pattern[i + 1 : i + 2] == "?":
            out.append("){0,1}")
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)
