"""Metrics and ``/cache`` figures of a predicting eviction policy (``reuse``), from an
``EngineStats`` snapshot: what it predicted for the leaves it evicted and what became of them.

An operator reads the two rates side by side: the mean predicted chance that an evicted leaf
comes back within the horizon, and the share that did (a request cached the same prefix again,
paying to recompute it). A policy that works evicts leaves that rarely come back, and its
predictions track what happens; a returned share well above the predicted one means the pool
is evicting what it should keep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixserve.engine.stats import EngineStats

COUNTERS = (  # (metric name, EvictionStats field, help)
    ("radix_eviction_predicted_leaves", "evicted_leaves",
     "Leaves evicted by a predicting policy (each with a predicted chance of return)"),
    ("radix_eviction_predicted_returns", "predicted_returns",
     "Sum over evicted leaves of their predicted chance of being used again within the horizon"),
    ("radix_eviction_returned_leaves", "returned_leaves",
     "Evicted leaves whose prefix was cached again within the horizon (came back)"),
    ("radix_eviction_returned_tokens", "returned_tokens",
     "Tokens of evicted leaves that came back and were computed again"),
    ("radix_eviction_reused_leaves", "reused_leaves",
     "Leaves used again while cached, within the horizon"),
)  # fmt: skip
GAUGES = (
    ("radix_eviction_horizon_touches", "horizon",
     "Tree touches within which a use counts as a return"),
    ("radix_eviction_age_touches", "eviction_age",
     "Mean idle age of evicted leaves, in tree touches"),
)  # fmt: skip


def eviction_families(s: EngineStats, model: str) -> Iterator[Any]:
    e = s.eviction
    if e is None:
        return
    for kind, table in ((CounterMetricFamily, COUNTERS), (GaugeMetricFamily, GAUGES)):
        for name, field, doc in table:
            family = kind(name, doc, labels=["model_name", "policy"])
            family.add_metric([model, e.policy], getattr(e, field))
            yield family


def cache_eviction(s: EngineStats) -> dict[str, Any] | None:
    """The policy's predictions and outcomes as ``/cache`` shows them (None: the policy does
    not predict)."""
    e = s.eviction
    if e is None:
        return None
    n = e.evicted_leaves
    return {
        **dataclasses.asdict(e),
        "predicted_return_rate": e.predicted_returns / n if n else None,
        "observed_return_rate": e.returned_leaves / n if n else None,
    }
