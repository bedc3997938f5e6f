"""The text the model wrote for each answer with tools this server gave, so that the answer,
re-sent in a later request's history, renders to that text and its KV is found in the cache.

A chat template re-renders an assistant turn from its parsed form: its text, then each call
as the template writes one (Qwen2.5: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n
</tool_call>``, the arguments re-serialized). That is seldom what the model wrote: a bare
JSON object or a fence, other spacing, text after the call, a call split from its text into
two items (the Responses API). The prompt then parts from the cached prefix at the first
re-sent call, and every turn recomputes every answer since.

``AnswerMemory`` keeps, per tenant, each answer parsed with tools (``remember``): the token
ids the model drew (when they spell its text exactly) and its text, under its parsed form:
the calls (name, arguments as a JSON value) and the text around them. ``restore`` puts a run
of consecutive assistant messages back into that answer when the run says exactly what the
answer says: the same calls in the same order with equal arguments, and the same text (its
parts joined with nothing, as chat completions' deltas add up, or with a blank line, as
Messages text blocks and Responses message items are joined here). ``encode_chat`` then
puts the answer's own token ids in the prompt where the template places its text (a text
re-tokenized may not give the tokens the model drew). Anything else renders as the template
does. The prompt thus holds what the client sent, in the tokens the model used; ids of calls
play no part (the content is the key), and one tenant's answers are never looked up for
another. Bounded: the tenants and each tenant's answers used least recently go first.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.api.tool_stream import Call, Text
from radixserve.api.tools import ToolPlan
from radixserve.model.tokenizer import Tokenizer

ANSWERS_PER_TENANT = 512
TENANTS = 1024
_SPACE = re.compile(r"\s+")
IDS = "answer_token_ids"  # in a restored message: the answer's own tokens


@dataclass(frozen=True)
class Answer:
    raw: str  # what the model wrote
    texts: tuple[str, ...]  # the text parts of its parsed form, in order
    ids: tuple[int, ...] | None  # the tokens it drew for ``raw`` (None: they spell more)


Recall = Callable[[str], Answer | None]  # an answer by its key, among one tenant's


def answer_key(calls: list[tuple[str, Any]], text: str) -> str:
    """The key of a parsed answer: its calls (name, arguments as JSON values) and its text
    without whitespace (which parts of text may be joined with; ``restore`` checks that)."""
    named = json.dumps(calls, sort_keys=True, ensure_ascii=False)
    return named + "\0" + _SPACE.sub("", text)


class AnswerMemory:
    def __init__(self, per_tenant: int = ANSWERS_PER_TENANT, tenants: int = TENANTS):
        self.per_tenant, self.tenants = per_tenant, tenants
        self._by_tenant: OrderedDict[str | None, OrderedDict[str, Answer]] = OrderedDict()

    def remember(
        self, tenant: str | None, plan: ToolPlan, raw: str, ids: tuple[int, ...] | None
    ) -> None:
        """Keep ``raw`` (drawn as ``ids``), an answer of ``tenant``'s that ``plan`` parses."""
        parser = plan.stream()
        pieces = parser.feed(raw) + parser.finish()
        texts: list[str] = []  # a text between two calls is one part, however it came
        calls = []
        for i, p in enumerate(pieces):
            if isinstance(p, Call):
                calls.append((p.name, json.loads(p.arguments)))
            elif i and isinstance(pieces[i - 1], Text):
                texts[-1] += p.text
            else:
                texts.append(p.text)
        answers = self._by_tenant.pop(tenant, None) or OrderedDict()
        self._by_tenant[tenant] = answers
        key = answer_key(calls, "".join(texts))
        answers.pop(key, None)
        answers[key] = Answer(raw, tuple(texts), ids)
        while len(answers) > self.per_tenant:
            answers.popitem(last=False)
        while len(self._by_tenant) > self.tenants:
            self._by_tenant.popitem(last=False)

    def recall(self, tenant: str | None) -> Recall:
        """A look-up among ``tenant``'s answers only."""

        def get(key: str) -> Answer | None:
            answers = self._by_tenant.get(tenant)
            found = answers.get(key) if answers is not None else None
            if found is not None:
                answers.move_to_end(key)
            return found

        return get


def restore(messages: list[dict[str, Any]], recall: Recall) -> list[dict[str, Any]]:
    """``messages`` with each run of assistant messages that is a remembered answer made
    one assistant message of the answer's text (no ``tool_calls``)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        j = i
        while j < len(messages) and messages[j].get("role") == "assistant":
            j += 1
        if j == i:
            out.append(messages[i])
            i += 1
            continue
        found = _recalled(messages[i:j], recall)
        out += (
            [{"role": "assistant", "content": found.raw, IDS: found.ids}]
            if found
            else messages[i:j]
        )
        i = j
    return out


def _recalled(run: list[dict[str, Any]], recall: Recall) -> Answer | None:
    """The remembered answer ``run`` says, if it says one exactly."""
    texts, calls = [], []
    for m in run:
        content = m.get("content") or ""
        if not isinstance(content, str):
            return None
        if content:
            texts.append(content)
        for c in m.get("tool_calls") or []:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
                return None
            try:
                calls.append((fn.get("name"), json.loads(fn["arguments"])))
            except json.JSONDecodeError:
                return None
    text = "\n\n".join(texts)
    found = recall(answer_key(calls, text))
    if found is None or text not in ("".join(found.texts), "\n\n".join(found.texts)):
        return None
    return found


def drawn_ids(tokenizer: Tokenizer, token_ids: list[int], text: str) -> tuple[int, ...] | None:
    """The tokens of an output that spell its ``text`` (its end-of-sequence token left
    out), or None when they spell something else (an output cut at a stop string)."""
    ids = list(token_ids)
    while ids and ids[-1] in tokenizer.eos_token_ids:
        ids.pop()
    return tuple(ids) if tokenizer.decode(ids, skip_special_tokens=False) == text else None


def encode_chat(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    tools: list | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The token ids of ``conversation`` through the chat template, each restored answer
    as the tokens the model drew for it (its text where the template does not place it
    once, as given)."""
    spliced = [m for m in conversation if m.get(IDS) is not None]
    if spliced:
        mark = f"\x00{uuid.uuid4().hex}\x00"
        marked = [{**m, "content": mark} if m.get(IDS) is not None else m for m in conversation]
        cuts = tokenizer.render_chat(marked, add_generation_prompt, tools).split(mark)
        if len(cuts) == len(spliced) + 1:
            ids = tokenizer.encode(cuts[0], add_special_tokens=False)
            for m, after in zip(spliced, cuts[1:], strict=True):
                ids += [*m[IDS], *tokenizer.encode(after, add_special_tokens=False)]
            return ids
    text = tokenizer.render_chat(conversation, add_generation_prompt, tools)
    return tokenizer.encode(text, add_special_tokens=False)
