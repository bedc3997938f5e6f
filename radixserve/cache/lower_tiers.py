"""The tiers below the device pool as the engine holds them: the tier controller, or none.

The engine holds its ``LowerTiers`` beside its prefix cache: a ``TierController``
(``tier_controller.py``) when it has a host tier (and maybe storage below it), else
``NO_TIERS``, which answers every call trivially, so callers never ask which they hold.

- ``load_back(match)`` copies the host part of a match onto the device (all of it, or the
  leading part the device has room for; skipped when too short to be worth it) and returns
  the match it became;
- ``start_prefetch`` asks the storage tier for the pages after the cached prefix of a waiting
  request: an opaque ticket with ``done``, ``expired(now)``, ``give_up()`` and
  ``tokens_from_storage(lo, hi)`` (``storage_io.Prefetch``), or None when there is nothing
  worth fetching;
- ``poll`` applies finished transfers, waiting up to ``timeout`` seconds for one;
- ``stats`` is a snapshot (``TierStats``), ``clear_storage`` deletes every page of the
  storage tier, ``close`` finishes pending writes and stops the I/O threads.
"""

from __future__ import annotations

from typing import Any, Protocol

from radixserve.cache.base import MatchResult, Namespace, TokenIds
from radixserve.cache.storage import ClearResult
from radixserve.cache.tier_stats import TierStats


class LowerTiers(Protocol):
    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring the host part of ``match`` onto the device; the match it became."""

    def start_prefetch(self, token_ids: TokenIds, namespace: Namespace = None) -> Any:
        """Start fetching from storage what follows the cached prefix (None: nothing to)."""

    def poll(self, timeout: float = 0.0) -> None:
        """Apply finished transfers between tiers (wait up to ``timeout`` s for one)."""

    def stats(self) -> TierStats | None:
        """A snapshot of the lower tiers, or None without them."""

    def clear_storage(self) -> ClearResult | None:
        """Delete every page in the storage tier: whether none is left (else why not), or
        None when there is no storage tier."""

    def close(self) -> None:
        """Finish pending writes to lower tiers and stop their threads."""


class NoTiers:
    """No tier below the device pool: nothing to load, fetch or report."""

    def load_back(self, match: MatchResult) -> MatchResult:
        return match

    def start_prefetch(self, token_ids: TokenIds, namespace: Namespace = None) -> None:
        return None

    def poll(self, timeout: float = 0.0) -> None:
        return None

    def stats(self) -> None:
        return None

    def clear_storage(self) -> None:
        return None

    def close(self) -> None:
        return None


NO_TIERS = NoTiers()
