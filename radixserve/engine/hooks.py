"""Feature hooks: how optional features attach to the engine's step without being the engine.

A feature (KV transfer between instances, the step trace, KV events, ...) subclasses
``Feature`` and overrides the hooks it needs; ``EngineCore`` calls every feature's hook at
that point of each step, in the order they were attached::

    EngineCore(...)      attach(core)          keep the ``CoreHandle`` if it acts on requests
    add(spec)            check(spec)           refuse what the feature cannot serve
    schedule()           before_schedule()     take work that arrived (transfer requests)
                         after_schedule(step)  see what the step will compute
    postprocess(...)     after_forward(step)   the step's KV is committed and published
    any finish           on_finish(req, reason, error)

A feature that must act on requests (add one, end one) is given a ``CoreHandle``: those two
verbs and nothing else of the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from radixserve.engine.request import Request
    from radixserve.engine.scheduler import Step
    from radixserve.engine.spec import RequestSpec


class CoreHandle(Protocol):
    """The narrow view of the engine a feature may act through."""

    def add(self, spec: RequestSpec) -> Request: ...

    def abort(self, request_id: str, reason: str = "abort") -> object: ...


class Feature:
    """No-op hooks; a feature overrides those it needs."""

    def attach(self, core: CoreHandle) -> None:
        pass

    def check(self, spec: RequestSpec) -> None:
        """Raise ``ValueError`` for a request this feature cannot serve."""

    def before_schedule(self) -> None:
        pass

    def after_schedule(self, step: Step) -> None:
        pass

    def after_forward(self, step: Step) -> None:
        pass

    def on_finish(self, req: Request, reason: str, error: str | None) -> None:
        """``req`` ended (``error``: the failure's exception name, when it failed)."""
