"""Prefill/decode disaggregation in the router: per request a decode instance and, unless
the decode instance should prefill it itself, a prefill instance, each chosen cache-aware
within its own set. Pure code, like ``policy.py``.

``PDPolicy`` stands in for a ``Policy`` in the router app (``route``, ``first_token``,
``finish``; worker registration and KV events go to the decode set), so the app's retries,
relay and ticket discipline apply unchanged. Per request:

1. the decode policy picks the decode instance (cache-aware: the prompt tokens its tree lacks,
   known from its KV events, plus its load);
2. conditional split: when that instance lacks fewer than ``local_prefill_tokens`` tokens, it
   prefills them itself (the header says ``local``) and no prefill instance is involved
   (moving them would cost more than computing them: docs/decisions.md, "Fleet");
3. otherwise the prefill policy picks a prefill instance by its own tree and load, and the
   request goes to the decode instance with the ``X-Radixserve-Prefill`` header naming that
   instance's KV endpoint. The decode ticket's pending prefill work is cleared at once (it is
   done elsewhere); the prefill ticket ends with the answer's first bytes, or with the request.

A prefill instance that fails is the decode instance's problem (it computes the prompt
itself); the router only stops choosing it once its health checks fail.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from radixserve.router.policy import Policy, Route, RouteRequest

PREFILL_HEADER = "x-radixserve-prefill"  # the server reads it (server/chat_run.py)
PREFILL_HERE = "local"  # the header's value that tells the decode instance to prefill itself


@dataclass(frozen=True)
class PDRoute(Route):
    prefill: Route | None = None  # None: the decode instance prefills the request itself


@dataclass
class PDStats:
    split: int = 0  # requests sent with a prefill instance
    local: int = 0  # requests the decode instance prefilled itself
    by_prefill: dict[str, int] = field(default_factory=dict)


class PDPolicy:
    name = "pd"

    def __init__(self, prefill: Policy, decode: Policy, local_prefill_tokens: int):
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
        self.prefill, self.decode = prefill, decode
        self.local_prefill_tokens = local_prefill_tokens
        self.endpoints: dict[str, str] = {}  # prefill worker URL -> its KV transfer endpoint
        self.pd_stats = PDStats()
        self._prefill_ticket: dict[int, Route] = {}  # decode ticket -> open prefill route

    def __getattr__(self, name: str) -> Any:
        # board, stats, config, workers, apply_events, ...: the decode set's, which the app
        # and its metrics see as "the workers"
        if name in ("prefill", "decode"):
            raise AttributeError(name)
        return getattr(self.decode, name)

    # ------------------------------------------------------------------ prefill instances
    def add_prefill(self, url: str, endpoint: str, has_events: bool = False) -> None:
        self.endpoints[url] = endpoint
        self.prefill.add_worker(url, has_events)

    def remove_prefill(self, url: str) -> None:
        self.prefill.remove_worker(url)

    # ------------------------------------------------------------------ requests
    def route(self, request: RouteRequest, now: float, exclude: Collection[str] = ()) -> PDRoute:
        d = self.decode.route(request, now, exclude)
        uncached = request.num_tokens - d.cached_tokens
        live = [w for w in self.prefill.workers if w in self.endpoints]
        if uncached < self.local_prefill_tokens or not live:
            self.pd_stats.local += 1
            headers = {PREFILL_HEADER: PREFILL_HERE}  # even if it has a default prefill peer
            return PDRoute(d.worker, d.ticket, d.cached_tokens, d.source, headers)
        p = self.prefill.route(request, now)
        self.decode.first_token(d.ticket)  # its prefill work is done elsewhere
        self._prefill_ticket[d.ticket] = p
        s = self.pd_stats
        s.split += 1
        s.by_prefill[p.worker] = s.by_prefill.get(p.worker, 0) + 1
        headers = {PREFILL_HEADER: self.endpoints[p.worker]}
        return PDRoute(d.worker, d.ticket, d.cached_tokens, d.source, headers, p)

    def first_token(self, ticket: int, now: float | None = None) -> None:
        self.decode.first_token(ticket, now)
        p = self._prefill_ticket.pop(ticket, None)
        if p is not None:
            self.prefill.finish(p.ticket, now=now)

    def finish(
        self, ticket: int, cached_tokens: int | None = None, now: float | None = None
    ) -> None:
        self.decode.finish(ticket, cached_tokens, now)
        p = self._prefill_ticket.pop(ticket, None)
        if p is not None:
            self.prefill.finish(p.ticket, now=now)

    def in_flight(self) -> int:
        return self.decode.in_flight() + self.prefill.in_flight()
