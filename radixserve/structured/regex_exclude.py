"""Exact lookahead-free forms of two pattern constructs the grammar engines do not enforce.

- ``without_lookahead(pattern)``: a pattern anchored at both ends that opens with a
  lookahead of literal alternatives, ``^(?!w1|w2)R$`` (or ``(?=...)``), as a pattern
  without it: the strings of ``R`` that start with none (one) of the words.
- ``excluding(pattern, words)``: the strings a pattern (``None``: any string) matches in
  full, except the listed ``words``: ``not`` of a ``const``/``enum`` on a string, or a
  condition's other case.

Both use Brzozowski derivatives on ``regex_ast`` trees: the strings of ``R`` that begin with
character ``c`` are ``c`` followed by the derivative ``D_c(R)``. Walking the words' trie,
each node ``p`` (a prefix of some word) writes the strings of ``D_p(R)`` as the empty string
(where ``D_p(R)`` takes it and ``p`` is not excluded), a trie character followed by that
child's form, or any other character class followed by its derivative (unconstrained by the
words from there on). Characters are taken by classes no set of ``R`` splits (and each word
character alone), so one derivative stands for the whole class. The result matches exactly
the strings the construct describes: no approximation, or ``RegexUnsupported`` (the pattern
stays refused).
"""

from __future__ import annotations

from radixserve.structured.regex_ast import (
    EMPTY,
    EPS,
    MAX,
    Node,
    RegexUnsupported,
    parse,
    union,
    write,
)

ANY: Node = ("rep", ("set", ((0, MAX),)), 0, None)
_WRITTEN_LIMIT = 20_000  # characters of a rewritten pattern


def without_lookahead(pattern: str) -> str:
    """``pattern`` (``^(?!w1|...)R$`` or ``^(?=w1|...)R$``) without its lookahead."""
    node = parse(pattern)
    items = node[1] if node[0] == "cat" else ()
    if len(items) < 3 or items[0] != ("bol",) or items[-1] != ("eol",) or items[1][0] != "look":
        raise RegexUnsupported("not a lookahead at the start of an anchored pattern")
    _, negative, look = items[1]
    rest = _cat(items[2:-1])
    _plain(rest)
    words = _words(look)
    if negative:
        return _anchored(_exclude(rest, _trie(words), prefix=True))
    return _anchored(_alt([_cat((_literal(w), _derive_word(rest, w))) for w in words]))


def excluding(pattern: str | None, words: list[str]) -> str:
    """A pattern of the full matches of ``pattern`` (anchored ``^...$``, or None for any
    string) other than ``words``."""
    rest = ANY
    if pattern is not None:
        node = parse(pattern)
        items = node[1] if node[0] == "cat" else ()
        if len(items) < 2 or items[0] != ("bol",) or items[-1] != ("eol",):
            raise RegexUnsupported("a pattern not anchored at both ends")
        rest = _cat(items[1:-1])
        _plain(rest)
    return _anchored(_exclude(rest, _trie(words), prefix=False))


def _anchored(node: Node) -> str:
    text = f"^(?:{write(node)})$"
    if len(text) > _WRITTEN_LIMIT:
        raise RegexUnsupported("the pattern without its lookahead would be too long")
    return text


def _plain(node: Node) -> None:
    """``RegexUnsupported`` where an anchor or a lookahead is left inside ``node``."""
    if node[0] in ("bol", "eol", "look"):
        raise RegexUnsupported("an anchor or a lookahead inside the pattern")
    if node[0] in ("cat", "alt"):
        for n in node[1]:
            _plain(n)
    elif node[0] == "rep":
        _plain(node[1])


def _words(node: Node) -> list[str]:
    """The literal alternatives of a lookahead (``RegexUnsupported`` for anything else)."""
    out = []
    for branch in node[1] if node[0] == "alt" else (node,):
        chars = branch[1] if branch[0] == "cat" else (branch,)
        if not all(c[0] == "set" and len(c[1]) == 1 and c[1][0][0] == c[1][0][1] for c in chars):
            raise RegexUnsupported("a lookahead that is not a list of literal words")
        out.append("".join(chr(c[1][0][0]) for c in chars))
    return out


def _trie(words: list[str]) -> dict:
    root: dict = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ord(ch), {})
        node[None] = True  # a word ends here
    return root


def _exclude(r: Node, trie: dict, prefix: bool) -> Node:
    """The strings of ``r`` that (``prefix``: start with) no word of ``trie`` (is)."""
    if prefix and trie.get(None):
        return EMPTY
    parts = [EPS] if _nullable(r) and not trie.get(None) else []
    by_derivative: dict[Node, list[tuple[int, int]]] = {}
    for lo, hi in _atoms(r, trie):
        d = _derive(r, lo)
        if d == EMPTY:
            continue
        if lo == hi and lo in trie:
            parts.append(_cat((("set", ((lo, lo),)), _exclude(d, trie[lo], prefix))))
        else:
            by_derivative.setdefault(d, []).append((lo, hi))
    for d, ranges in by_derivative.items():
        parts.append(_cat((("set", union(ranges)), d)))
    return _alt(parts)


def _atoms(r: Node, trie: dict) -> list[tuple[int, int]]:
    """Character classes no set of ``r`` splits, each trie character one alone."""
    cuts = {0, MAX + 1}
    for lo, hi in _ranges(r):
        cuts |= {lo, hi + 1}
    for ch in trie:
        if ch is not None:
            cuts |= {ch, ch + 1}
    edges = sorted(cuts)
    return [(a, b - 1) for a, b in zip(edges, edges[1:], strict=False)]


def _ranges(node: Node):
    if node[0] == "set":
        yield from node[1]
    elif node[0] in ("cat", "alt"):
        for n in node[1]:
            yield from _ranges(n)
    elif node[0] == "rep":
        yield from _ranges(node[1])


def _nullable(node: Node) -> bool:
    kind = node[0]
    if kind == "set":
        return False
    if kind == "cat":
        return all(_nullable(n) for n in node[1])
    if kind == "alt":
        return any(_nullable(n) for n in node[1])
    return node[2] == 0 or _nullable(node[1])


def _derive(node: Node, c: int) -> Node:
    """The strings ``s`` such that ``chr(c) + s`` is in ``node``."""
    kind = node[0]
    if kind == "set":
        return EPS if any(lo <= c <= hi for lo, hi in node[1]) else EMPTY
    if kind == "alt":
        return _alt([_derive(n, c) for n in node[1]])
    if kind == "cat":
        if not node[1]:
            return EMPTY
        head, rest = node[1][0], _cat(node[1][1:])
        first = _cat((_derive(head, c), rest))
        return _alt([first, _derive(rest, c)]) if _nullable(head) else first
    _, sub, low, high = node
    if high == 0:
        return EMPTY
    return _cat((_derive(sub, c), _rep(sub, max(low - 1, 0), None if high is None else high - 1)))


def _derive_word(node: Node, word: str) -> Node:
    for ch in word:
        node = _derive(node, ord(ch))
    return node


def _literal(word: str) -> Node:
    return _cat(tuple(("set", ((ord(c), ord(c)),)) for c in word))


def _cat(items) -> Node:
    flat: list[Node] = []
    for n in items:
        if n == EMPTY:
            return EMPTY
        flat.extend(n[1] if n[0] == "cat" else (n,))
    return flat[0] if len(flat) == 1 else ("cat", tuple(flat))  # EPS when empty


def _alt(items) -> Node:
    flat: list[Node] = []
    for n in items:
        for b in n[1] if n[0] == "alt" else (n,):
            if b not in flat:
                flat.append(b)
    return flat[0] if len(flat) == 1 else ("alt", tuple(flat))  # EMPTY when empty


def _rep(sub: Node, low: int, high: int | None) -> Node:
    if high == 0:
        return EPS
    if (low, high) == (1, 1):
        return sub
    return ("rep", sub, low, high)
