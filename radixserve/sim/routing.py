"""The fleet router's policies driven in simulated time, with KV events delayed or lost.

The policies are ``radixserve.router.policy``'s own classes (the ones ``radixserve router``
runs): the simulator registers its instances as workers, names each prompt by the same
chained block hashes the engine's events use (``kvevents.hashing``), and keeps the policy's
tickets exactly as the router does (route, first token, finish with the cached tokens the
instance reports). Names:

| name | policy |
|---|---|
| ``random`` | uniform choice (a baseline; built on the router's ``Policy`` base class) |
| ``round-robin``, ``least-load``, ``power-of-two`` | the router's |
| ``consistent-hash`` | the router's, keyed by the session (conversation) id |
| ``cache-aware`` | the router's, its index fed by every instance's KV events |
| ``cache-aware-approx`` | the router's, with no events: only its routing history |

Events leave an instance at the end of the step that caused them and reach the policy
``event_delay`` seconds later; each step's batch is lost with probability ``event_loss``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.cache.base import Namespace
from radixserve.kvevents.hashing import chain_block_hashes
from radixserve.router.policy import Policy, PolicyConfig, RouteRequest, make_policy

ROUTING_POLICIES = (
    "random",
    "round-robin",
    "least-load",
    "power-of-two",
    "consistent-hash",
    "cache-aware",
    "cache-aware-approx",
)


class RandomChoice(Policy):
    name = "random"

    def choose(self, request, now, exclude):
        pool = [w for w in self.workers if w not in exclude]
        return self._rng.choice(pool), 0, "none"


@dataclass
class RoutingConfig:
    policy: str = "cache-aware"
    event_delay: float = 0.0  # seconds from a step's end to the router applying its events
    event_loss: float = 0.0  # probability that one step's events never arrive
    seed: int = 0
    policy_args: dict[str, Any] = field(default_factory=dict)  # PolicyConfig fields

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(
                f"unknown routing policy {self.policy!r}; choose one of {ROUTING_POLICIES}"
            )
        if not self.event_delay >= 0:
            raise ValueError(f"event_delay must be >= 0 seconds, got {self.event_delay}")
        if not 0 <= self.event_loss <= 1:
            raise ValueError(f"event_loss must be in [0, 1], got {self.event_loss}")
        known = {f.name for f in dataclasses.fields(PolicyConfig)} - {"block_size"}
        unknown = sorted(set(self.policy_args) - known)
        if unknown:
            raise ValueError(f"unknown router option(s) {unknown}; known: {sorted(known)}")

    @property
    def uses_events(self) -> bool:
        return self.policy == "cache-aware"


class SimRouter:
    """One routing policy over ``num_instances`` simulated workers named ``"0"``, ``"1"``..."""

    def __init__(self, config: RoutingConfig, num_instances: int, block_size: int):
        self.config = config
        self.block_size = block_size
        pc = PolicyConfig(block_size=block_size, **config.policy_args)
        if config.policy == "random":
            self.policy: Policy = RandomChoice(pc, config.seed)
        else:
            base = config.policy.removesuffix("-approx")
            self.policy = make_policy(base, pc, config.seed)
        self._names = [str(i) for i in range(num_instances)]
        for name in self._names:
            self.policy.add_worker(name, has_events=config.uses_events)
        # only cache-aware reads the prompt's block hashes (consistent-hash is keyed by the
        # session here): the cache-blind policies skip hashing every prompt
        self._needs_hashes = config.policy.startswith("cache-aware")
        self._loss = random.Random(config.seed + 1)
        self._session_hashes: dict[str, tuple[np.ndarray, list[int]]] = {}
        self.events_lost = 0
        self.events_applied = 0

    def route(self, prompt, namespace: Namespace, session_id: str, now: float) -> tuple[int, int]:
        """(instance index, ticket)."""
        if len(self._names) == 1:
            return 0, -1
        hashes = self._block_hashes(prompt, namespace, session_id) if self._needs_hashes else []
        route = self.policy.route(RouteRequest(hashes, len(prompt), session_id), now)
        return int(route.worker), route.ticket

    def _block_hashes(self, prompt: np.ndarray, namespace: Namespace, session_id: str) -> list[int]:
        """The prompt's chained block hashes. A chat's next prompt extends the previous one,
        so the session's hashes are extended (after checking the prefix is unchanged), not
        recomputed: the same values, in time linear in the conversation."""
        b, blocks = self.block_size, len(prompt) // self.block_size
        tokens, hashes = self._session_hashes.get(session_id, (prompt[:0], []))
        k = len(hashes)
        if k > blocks or not np.array_equal(tokens[: k * b], prompt[: k * b]):
            k, hashes = 0, []
        if blocks > k:
            parent = hashes[-1] if hashes else None
            hashes = hashes + chain_block_hashes(parent, prompt[k * b : blocks * b], b, namespace)
        self._session_hashes[session_id] = (prompt, hashes)
        return hashes[:blocks]

    def forget_session(self, session_id: str) -> None:
        self._session_hashes.pop(session_id, None)

    def first_token(self, ticket: int, now: float) -> None:
        if ticket >= 0:
            self.policy.first_token(ticket, now)

    def finish(self, ticket: int, cached_tokens: int, now: float) -> None:
        if ticket >= 0:
            self.policy.finish(ticket, cached_tokens, now)

    def keep_batch(self) -> bool:
        """Draw whether one step's event batch survives."""
        if self.config.event_loss and self._loss.random() < self.config.event_loss:
            self.events_lost += 1
            return False
        return True

    def apply_events(self, instance: int, events: list) -> None:
        self.events_applied += 1
        self.policy.apply_events(self._names[instance], events)

    def stats(self) -> dict[str, Any]:
        s = self.policy.stats
        precision = s.confirmed_tokens / s.predicted_tokens if s.predicted_tokens else None
        return {
            "policy": self.config.policy,
            "routes": s.routes,
            "predicted_cached_tokens": s.predicted_tokens,
            "routing_precision": precision,
            "by_source": dict(s.by_source),
            "event_batches_applied": self.events_applied,
            "event_batches_lost": self.events_lost,
        }
