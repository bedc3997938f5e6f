"""ChatInput: the one request form under the three chat APIs (chat completions, Anthropic
Messages, OpenAI Responses). Each API's edge module turns its body into a ``ChatInput``;
everything below (the chat template, tools, grammars, tenants, limits, the engine's
``RequestSpec``) is shared, so the APIs differ in their bodies, responses, streams and error
shapes only.

``messages`` are in chat completions' form, the one the chat template takes: roles ``system``,
``user``, ``assistant`` (with ``tool_calls`` in OpenAI's shape) and ``tool`` (with the
``tool_call_id`` it answers), content as text. Every tool result must answer a call made
earlier in the conversation (a 400 names the id otherwise), but one the client gives
unasked (no ``tool_call_id``, a ``name``: a Responses item). ``cache_points`` are the prefixes
to pin (``cache/pins.py``): the ``cache_control`` breakpoints of a Messages request, or the
``cache_pin`` extension of the OpenAI-style APIs; the prefix through message ``message`` is to
stay on the device for ``ttl``. ``pins_asked``: the points were asked for explicitly (the
extension), so a server with pins off refuses them; ``cache_control`` is advice there (every
prefix is cached anyway). ``notes`` are what the edge left out (a hosted tool this server does
not have), for a warning header and the log. ``fit_max_tokens``: a ``max_tokens`` larger than
the context left after the prompt is lowered to what remains (the Messages and Responses APIs,
whose clients send their own model's output limit) instead of refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from radixserve.api.answers import Recall, restore
from radixserve.api.errors import ApiError
from radixserve.api.tools import ToolPlan, history_message
from radixserve.engine.sampling_params import SamplingParams

TTLS = {"5m": 300, "1h": 3600}  # cache_control's time to live, in seconds


MAX_CACHE_POINTS = 4  # as in Anthropic's API


@dataclass(frozen=True)
class CachePoint:
    message: int  # index into ChatInput.messages: the prefix through this message
    ttl: str | int  # a key of TTLS, or seconds

    @property
    def seconds(self) -> float:
        return float(TTLS[self.ttl] if isinstance(self.ttl, str) else self.ttl)


@dataclass(frozen=True)
class ChatInput:
    messages: list[dict[str, Any]]
    plan: ToolPlan | None
    grammar: tuple[str, str] | None
    params: list[SamplingParams]  # one per choice
    salt: str | None = None
    fit_max_tokens: bool = False
    cache_points: tuple[CachePoint, ...] = ()
    pins_asked: bool = False
    notes: tuple[str, ...] = ()

    @classmethod
    def build(
        cls,
        messages: list[dict[str, Any]],
        plan: ToolPlan | None,
        grammar: tuple[str, str] | None,
        params: list[SamplingParams],
        param: str = "messages",
        **options: Any,
    ) -> ChatInput:
        """Check what the APIs share: a conversation to answer, tool results that answer
        calls, at most one output constraint (a forced tool call is one)."""
        if not messages:
            raise ApiError(400, f"{param} must not be empty", param)
        check_tool_results(messages, param)
        if plan is not None and plan.grammar is not None:
            if grammar is not None:
                raise ApiError(
                    400,
                    "a forced tool call (tool_choice) cannot be combined with "
                    "an output format or a grammar",
                    "tool_choice",
                )
            grammar = plan.grammar
        return cls(messages, plan, grammar, params, **options)

    def render(
        self, template_has_tools: bool, recall: Recall | None = None, upto: int | None = None
    ) -> tuple[list[dict[str, Any]], list | None]:
        """The conversation (its first ``upto`` messages) and the ``tools`` argument for
        the chat template; with ``recall`` (the tenant's ``AnswerMemory``), the answers this
        server gave as the model wrote them (``answers.py``)."""
        messages = self.messages[:upto]
        if recall is not None:
            messages = restore(messages, recall)
        conversation = [
            history_message(m, template_has_tools) if m.get("tool_calls") else m for m in messages
        ]
        if self.plan is None:
            return conversation, None
        return self.plan.render(conversation, template_has_tools)

    def fitted(self, prompt_tokens: int, room: int) -> list[SamplingParams]:
        """The choices' parameters with ``max_tokens`` at most what the context has left
        (``room``: the model's context, or the KV pool if smaller) after the prompt."""
        left = room - prompt_tokens
        if not self.fit_max_tokens or left < 1:
            return self.params  # a prompt that does not fit is refused by the caller
        return [
            p
            if p.max_tokens is not None and p.max_tokens <= left
            else dataclasses.replace(p, max_tokens=left)
            for p in self.params
        ]


def check_tool_results(messages: list[dict[str, Any]], param: str = "messages") -> None:
    """A 400 for a tool result whose id no earlier assistant message called."""
    called: set[str] = set()
    for m in messages:
        for call in m.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                called.add(call["id"])
        unasked = m.get("tool_call_id") is None and isinstance(m.get("name"), str)
        if m.get("role") == "tool" and not unasked and m.get("tool_call_id") not in called:
            raise ApiError(
                400,
                f"a tool result answers the id {m.get('tool_call_id')!r}, "
                "which no earlier assistant turn called",
                param,
            )
