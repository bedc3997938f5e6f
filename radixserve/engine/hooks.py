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

``KVTransfer`` is the interface of one feature the engine knows by role: KV moving between
instances (prefill/decode disaggregation, implemented in ``radixserve/disagg``). Whoever
builds an engine in a disaggregation mode hands it a factory of one
(``Engine(config, transfer=...)``), so the engine never imports the transfer's code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from radixserve.engine.kv_source import KVSource
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


class KVTransfer(Feature):
    """KV moving between instances: a feature that also has an endpoint to report, traffic
    that wakes an idle engine loop, and, on the receiving side, a ``KVSource``."""

    kv_source: KVSource | None = None

    def fileno(self) -> int:
        """A descriptor readable when transfer traffic needs a step."""
        raise NotImplementedError

    def info(self) -> Any:
        """What ``EngineInfo.disaggregation`` reports (mode, layout, endpoint)."""
        raise NotImplementedError

    def stats(self) -> Any:
        """A snapshot of the transfer counters (``EngineStats.kv_transfer``)."""
        raise NotImplementedError

    def close(self) -> None:
        pass
