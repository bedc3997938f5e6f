"""Pins: cached prefixes kept on the device pool for a time to live, within a token budget.

A pin names a cached prefix (its tokens in a namespace) and an owner (a tenant) and holds a
lock on the path to the node its prefix ends in, the same lock a running request takes
(``RadixCache.inc_lock_ref``): a locked node is never an evictable leaf, so eviction skips it
at no cost (no scan, no check per eviction) and whatever the policy.

Budgets. ``pinned_tokens`` counts the distinct tokens under at least one pin (nested pins,
a system prompt and the conversation that grows after it, share their common part); each
tenant's count is the same over that tenant's pins. Both are kept per node in O(path): a pin
adds itself to the owner counts of its path's nodes. A new pin longer than a budget is
refused (``refused_budget``); one that fits but puts a total over its budget demotes the
least recently used other pins (of the tenant, then of the server) until both hold again;
so does a request that could never run beside the pins (``give_way``).
A demoted pin is unlocked, and with a host tier its path is copied there first, so the
prefix leaves the device (when the device needs room) for the host instead of vanishing.

Time. Pins expire at ``expires_at`` on the table's clock (``clock``, monotonic seconds;
tests give their own). ``expire`` drops due pins in O(log n) each (a lazy heap); it is
called before every step. A request admitted through a pinned prefix refreshes the pin to
a full time to live (``on_hit``), as a cache hit refreshes Anthropic's cache entries; so does
pinning it again.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.cache.base import Namespace, TokenIds, as_token_array
from radixserve.cache.tree_listener import TreeListener
from radixserve.cache.tree_node import TreeNode

MAX_PIN_TTL_S = 3600.0  # the longest time to live a pin may ask for (Anthropic's longest)


@dataclass
class Pin:
    id: int
    node: TreeNode  # where the prefix ends (locked while the pin holds)
    tenant: str
    namespace: Namespace
    tokens: int
    ttl: float
    expires_at: float
    last_used: float
    head: list[int] = field(default_factory=list)  # its first tokens, for listings


@dataclass(frozen=True)
class PinInfo:
    """One pin as ``/admin/pins`` and ``/cache`` list it (it crosses the process boundary)."""

    id: int
    tenant: str
    namespace: Namespace
    tokens: int
    ttl: float
    expires_in: float
    idle: float  # seconds since it was last used
    head_token_ids: list[int]


@dataclass
class PinStats:
    """What ``/metrics`` and ``/cache`` show: sizes now, and monotonic counters."""

    budget_tokens: int = 0
    tenant_budget_tokens: int = 0
    pins: int = 0
    pinned_tokens: int = 0  # distinct tokens under a pin
    tenant_tokens: dict[str, int] = field(default_factory=dict)
    created: int = 0
    refreshed: int = 0
    expired: int = 0
    demoted: int = 0  # put out by newer pins over a budget
    demoted_to_host: int = 0  # of which copied to the host tier first
    refused_budget: int = 0  # longer than a budget by itself
    not_cached: int = 0  # the prefix was not (wholly) on the device to pin
    unpinned: int = 0  # by an admin


class PinTable(TreeListener):
    order = 3  # after the tier controller: it only reads the tree

    def __init__(
        self,
        tree: Any,
        budget_tokens: int,
        tenant_budget_tokens: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        backup: Callable[[TreeNode], bool] | None = None,
    ):
        """Pins over ``tree`` (a ``RadixCache``): at most ``budget_tokens`` pinned, at most
        ``tenant_budget_tokens`` (default: all of it) per tenant; ``backup`` copies a device
        node to the host tier (the tier controller's), used when a pin is demoted."""
        if budget_tokens < 0 or (tenant_budget_tokens is not None and tenant_budget_tokens < 0):
            raise ValueError("pin budgets must be >= 0 tokens")
        self.tree, self.clock, self.backup = tree, clock, backup
        self.stats = PinStats(budget_tokens, min(tenant_budget_tokens or budget_tokens,
                                                 budget_tokens))  # fmt: skip
        self._pins: OrderedDict[tuple[int, str], Pin] = OrderedDict()  # least recent first
        self._owners: dict[int, dict[str, int]] = {}  # node id -> tenant -> pins through it
        self._ending: dict[int, list[Pin]] = {}  # node id -> the pins that end there
        self._expiry: list[tuple[float, int, tuple[int, str]]] = []  # lazy heap
        self._next_id = 0
        tree.add_listener(self)

    # ------------------------------------------------------------------ pinning
    def pin(
        self, token_ids: TokenIds, namespace: Namespace, tenant: str | None, ttl: float
    ) -> Pin | None:
        """Pin the cached prefix ``token_ids`` (whole pages of it) for ``ttl`` seconds;
        the pin (new or refreshed), or None when it is not cached or over a budget."""
        if not 0 < ttl <= MAX_PIN_TTL_S:
            raise ValueError(f"a pin's ttl must be in (0, {MAX_PIN_TTL_S:g}] seconds, got {ttl!r}")
        key = as_token_array(token_ids)
        end = len(key) - len(key) % self.tree.page_size
        tenant = tenant or ""
        match = self.tree.match_prefix(key[:end], namespace, record_stats=False)
        if end == 0 or match.device_len != end:
            self.stats.not_cached += 1
            return None
        node, now = match.handle, self.clock()
        pin = self._pins.get((node.id, tenant))
        if pin is not None:
            pin.ttl = max(pin.ttl, ttl)
            self._refresh(pin, now)
            return pin
        s = self.stats
        if end > s.budget_tokens or end > s.tenant_budget_tokens:
            s.refused_budget += 1
            return None
        self._next_id += 1
        pin = Pin(self._next_id, node, tenant, namespace, end, ttl, now + ttl, now,
                  key[: min(end, 32)].tolist())  # fmt: skip
        self._hold(pin)
        s.created += 1
        self._fit_budgets(pin)
        return pin

    def _hold(self, pin: Pin) -> None:
        self.tree.inc_lock_ref(pin.node)
        s, tenant = self.stats, pin.tenant
        for n in _path(pin.node):
            owners = self._owners.setdefault(n.id, {})
            if not owners:
                s.pinned_tokens += len(n.key)
            if tenant not in owners:
                s.tenant_tokens[tenant] = s.tenant_tokens.get(tenant, 0) + len(n.key)
            owners[tenant] = owners.get(tenant, 0) + 1
        self._pins[(pin.node.id, tenant)] = pin
        self._ending.setdefault(pin.node.id, []).append(pin)
        s.pins += 1
        heapq.heappush(self._expiry, (pin.expires_at, pin.id, (pin.node.id, tenant)))

    def _release(self, pin: Pin) -> None:
        s, tenant = self.stats, pin.tenant
        for n in _path(pin.node):
            owners = self._owners[n.id]
            owners[tenant] -= 1
            if not owners[tenant]:
                del owners[tenant]
                s.tenant_tokens[tenant] -= len(n.key)
            if not owners:
                del self._owners[n.id]
                s.pinned_tokens -= len(n.key)
        if not s.tenant_tokens.get(tenant):
            s.tenant_tokens.pop(tenant, None)
        del self._pins[(pin.node.id, tenant)]
        ending = self._ending[pin.node.id]
        ending.remove(pin)
        if not ending:
            del self._ending[pin.node.id]
        s.pins -= 1
        self.tree.dec_lock_ref(pin.node)

    def _fit_budgets(self, new: Pin) -> None:
        """Demote the least recently used other pins until the tenant's and the server's
        totals are within their budgets (``new`` alone is within both)."""
        s = self.stats
        while s.tenant_tokens.get(new.tenant, 0) > s.tenant_budget_tokens:
            self._demote(next(p for p in self._pins.values()
                              if p.tenant == new.tenant and p is not new))  # fmt: skip
        while s.pinned_tokens > s.budget_tokens:
            self._demote(next(p for p in self._pins.values() if p is not new))

    def give_way(self, num_slots: int) -> int:
        """Demote pins, least recently used first, until ``num_slots`` device slots are
        obtainable (free or evictable) or no pin is left; how many were demoted."""
        demoted = 0
        while self._pins and self.tree.room() < num_slots:
            self._demote(next(iter(self._pins.values())))
            demoted += 1
        return demoted

    def _demote(self, pin: Pin) -> None:
        """Unpin ``pin``; with a host tier, copy its path there first, so that when the device
        evicts it, it stays a host hit."""
        copied = False
        if self.backup is not None:
            copied = all(n.host_value is not None or self.backup(n) for n in _path(pin.node))
        self._release(pin)
        self.stats.demoted += 1
        self.stats.demoted_to_host += copied

    def _refresh(self, pin: Pin, now: float) -> None:
        pin.last_used, pin.expires_at = now, now + pin.ttl
        self._pins.move_to_end((pin.node.id, pin.tenant))
        heapq.heappush(self._expiry, (pin.expires_at, pin.id, (pin.node.id, pin.tenant)))
        self.stats.refreshed += 1
        if len(self._expiry) > 2 * len(self._pins) + 64:
            self._expiry = [(p.expires_at, p.id, k) for k, p in self._pins.items()]
            heapq.heapify(self._expiry)

    def expire(self) -> int:
        """Drop the pins whose time is up; how many."""
        now, dropped = self.clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            _, pin_id, key = heapq.heappop(self._expiry)
            pin = self._pins.get(key)
            if pin is not None and pin.id == pin_id and pin.expires_at <= now:
                self._release(pin)
                self.stats.expired += 1
                dropped += 1
        return dropped

    def unpin(self, token_ids: TokenIds | None = None, namespace: Namespace = None,
              tenant: str | None = None, pin_id: int | None = None) -> int:  # fmt: skip
        """Drop the pins of the prefix ``token_ids`` (or the pin ``pin_id``; or every pin
        when both are None), of ``tenant`` only when given; how many were dropped."""
        if pin_id is not None:
            chosen = [p for p in self._pins.values() if p.id == pin_id]
        elif token_ids is not None:
            key = as_token_array(token_ids)
            end = len(key) - len(key) % self.tree.page_size
            match = self.tree.match_prefix(key[:end], namespace, record_stats=False)
            chosen = list(self._ending.get(match.handle.id, ())) if match.device_len == end else []
        else:
            chosen = list(self._pins.values())
        chosen = [p for p in chosen if tenant is None or p.tenant == tenant]
        for p in chosen:
            self._release(p)
        self.stats.unpinned += len(chosen)
        return len(chosen)

    # ------------------------------------------------------------------ inspection
    def pins(self) -> list[Pin]:
        """The pins, least recently used first."""
        return list(self._pins.values())

    def listing(self) -> list[PinInfo]:
        """The pins as plain values, most recently used first."""
        now = self.clock()
        return [
            PinInfo(
                p.id,
                p.tenant,
                p.namespace,
                p.tokens,
                p.ttl,
                p.expires_at - now,
                now - p.last_used,
                list(p.head),
            )  # fmt: skip
            for p in reversed(self._pins.values())
        ]

    def snapshot(self) -> PinStats:
        s = self.stats
        return PinStats(**{**s.__dict__, "tenant_tokens": dict(s.tenant_tokens)})

    # ------------------------------------------------------------------ what the tree tells
    def on_split(self, upper: TreeNode, lower: TreeNode, n: int) -> None:
        owners = self._owners.get(lower.id)
        if owners:  # every pin through the lower part runs through the upper one too
            self._owners[upper.id] = dict(owners)

    def on_hit(self, node: TreeNode | None) -> None:
        if not self._pins:
            return
        now = None
        for n in _path(node):
            for pin in self._ending.get(n.id, ()):
                now = self.clock() if now is None else now
                self._refresh(pin, now)

    def check(self, held: torch.Tensor | None) -> None:
        owners: dict[int, dict[str, int]] = {}
        for (node_id, tenant), pin in self._pins.items():
            assert pin.node.id == node_id and pin.node.lock_ref > 0 and pin.node.value is not None
            for n in _path(pin.node):
                counts = owners.setdefault(n.id, {})
                counts[tenant] = counts.get(tenant, 0) + 1
        assert owners == self._owners, "pin owner counts disagree with the pins"
        assert self.stats.pins == len(self._pins)


def _path(node: TreeNode | None):
    """``node`` and its ancestors below the root."""
    while node is not None and node.parent is not None:
        yield node
        node = node.parent
