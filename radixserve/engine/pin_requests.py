"""PinRequests: the engine feature that turns requests' pins into pins on the tree.

A request's spec names prompt prefixes to pin (``RequestSpec.pins``: prompt tokens and a time
to live). Once its prompt is computed through a prefix (the step that publishes it to the
tree), that prefix is pinned for the request's tenant (``cache/pins.py``); a prefix already
pinned is refreshed. Before every step, pins whose time is up are dropped. The pins' clock is
the table's (monotonic seconds unless a test gives another).

Budgets are the table's: a prefix longer than a budget stays unpinned (counted as refused),
a request is never refused for its pins.
"""

from __future__ import annotations

from radixserve.cache.pins import PinTable
from radixserve.engine.hooks import Feature
from radixserve.engine.request import Request
from radixserve.engine.scheduler import Step


class PinRequests(Feature):
    def __init__(self, table: PinTable):
        self.table = table
        self._done: dict[str, int] = {}  # request id -> how many of its pins are applied

    def before_schedule(self) -> None:
        self.table.expire()

    def after_forward(self, step: Step) -> None:
        for req, _ in step.prefills:
            if req.spec.pins:
                self._apply(req, sorted(req.spec.pins))

    def _apply(self, req: Request, pins: list[tuple[int, float]]) -> None:
        done = self._done.get(req.request_id, 0)
        cached = req.kv.cached  # published: in the tree, on the device
        page = self.table.tree.page_size
        while done < len(pins) and pins[done][0] // page * page <= cached:
            end, ttl = pins[done]
            self.table.pin(req.token_ids[:end], req.namespace, req.spec.tenant, ttl)
            done += 1
        self._done[req.request_id] = done

    def on_finish(self, req: Request, reason: str, error: str | None) -> None:
        self._done.pop(req.request_id, None)
