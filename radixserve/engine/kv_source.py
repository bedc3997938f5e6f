"""KVSource: somewhere an admitted request's missing KV can come from instead of being
computed here: another instance (prefill/decode disaggregation) or, by the same contract, a
lower cache tier. The scheduler drives it; the source never touches the ledger::

    admit: match + lock ──> n = source.plan(req, cached)  0: compute here as usual
           allocate n slots after the matched prefix (allocated = computed + n)
           source.start(req)                              the request waits in `loading`,
                                                          holding its slots, running nothing
    every schedule(): for (req, reason) in source.poll():
           reason None: the n tokens' KV is in the slots ──> commit n, publish, run
           else: release everything (nothing leaks) and queue the request again with
                 ``req.kv_source_failed`` set, so it is computed here this time
    finish / abort while loading: source.cancel(req) first: after it returns, nothing more is
           written into the request's slots, so releasing them is safe

A load that cannot be planned (no peer, too few tokens to be worth moving) costs nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.engine.request import Request


class KVSource(ABC):
    @abstractmethod
    def plan(self, req: Request, cached: int) -> int:
        """Tokens after ``req``'s matched prefix (``cached`` tokens) to load rather than
        compute (0: none). Asked before admission, so it must not change anything."""

    @abstractmethod
    def start(self, req: Request) -> None:
        """Start filling ``req.kv.slots[computed:allocated]``; never blocks."""

    @abstractmethod
    def poll(self) -> list[tuple[Request, str | None]]:
        """Loads that ended since the last call, each once: ``None`` for success, else why
        it failed (the timeout included)."""

    @abstractmethod
    def cancel(self, req: Request) -> None:
        """Stop ``req``'s load; afterwards nothing writes into its slots."""

    def has_pending(self) -> bool:
        """True while any load is under way (the engine loop then wakes to poll)."""
        return False
