"""Metrics and ``/cache`` figures of the hierarchical cache, from an ``EngineStats`` snapshot.

Always: prompt tokens served from the cache per tier (``device``, ``host``, ``storage``; the
host and storage counters stay at 0 without those tiers). With a host tier: its capacity and
use, pages and bytes moved per direction, the load-back latency histogram, load and copy
failures; with a storage tier too: prefetches and their timeouts, what the store holds and
its read, write and corrupt-page errors. With pins on: pinned tokens (per tenant) and pin
events (created, refreshed, expired, demoted, refused for the budget).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from radixserve.engine.stats import EngineStats

DIRECTIONS = {  # label -> (pages field, bytes field) of TierStats
    "device_to_host": ("pages_to_host", "bytes_to_host"),
    "host_to_device": ("pages_to_device", "bytes_to_device"),
    "host_to_storage": ("pages_to_storage", "bytes_to_storage"),
    "storage_to_host": ("pages_from_storage", "bytes_from_storage"),
}


def _family(kind: type, name: str, doc: str, model: str, value: Any, label: str | None = None):
    """One metric family; with ``label``, ``value`` maps each label value to a number."""
    family = kind(name, doc, labels=["model_name"] + ([label] if label else []))
    for key, v in value.items() if label else [(None, value)]:
        family.add_metric([model] if key is None else [model, key], v)
    return family


def tier_families(s: EngineStats, model: str) -> Iterator[Any]:
    c, t = s.cache, s.tiers
    by_tier = {
        "device": c.hit_tokens - c.host_hit_tokens - c.storage_hit_tokens,
        "host": c.host_hit_tokens,
        "storage": c.storage_hit_tokens,
    }
    doc = "Prompt tokens served from the cache, by the tier they came from"
    yield _family(
        CounterMetricFamily, "radix_cache_hit_tokens_by_tier", doc, model, by_tier, "tier"
    )
    if t is None:
        return
    gauges = [
        ("kv_host_capacity_tokens", "Host KV tier size in tokens", t.host_capacity_tokens),
        ("kv_host_cached_tokens", "Tokens with a copy in the host KV tier", t.host_cached_tokens),
    ]
    for name, doc, value in gauges:
        yield _family(GaugeMetricFamily, name, doc, model, value)
    pages = {d: getattr(t, p) for d, (p, _) in DIRECTIONS.items()}
    nbytes = {d: getattr(t, b) for d, (_, b) in DIRECTIONS.items()}
    doc = "KV pages copied between tiers"
    yield _family(CounterMetricFamily, "kv_tier_pages_moved", doc, model, pages, "direction")
    doc = "KV bytes copied between tiers"
    yield _family(CounterMetricFamily, "kv_tier_bytes_moved", doc, model, nbytes, "direction")
    hist = HistogramMetricFamily(
        "kv_load_back_seconds", "Host-to-device load time per request", labels=["model_name"]
    )
    hist.add_metric([model], t.load_latency.cumulative(), sum_value=t.load_latency.total)
    yield hist
    events = {
        "load_back_failed": t.load_failures,
        "host_copy_failed": t.backup_failures,
        "host_evicted_tokens": t.host_evicted_tokens,
    }
    doc = "Host tier events (see the label)"
    yield _family(CounterMetricFamily, "kv_tier_events", doc, model, events, "event")
    if t.storage_url is None:
        return
    counters = [
        ("kv_storage_prefetches", "Storage lookups started for waiting requests", t.prefetches),
        (
            "kv_storage_prefetch_timeouts",
            "Requests admitted before their storage prefetch finished (pages computed)",
            t.prefetch_timeouts,
        ),
        (
            "kv_storage_write_skipped_pages",
            "Pages not written to storage: too many writes were pending",
            t.storage_write_skipped_pages,
        ),
    ]
    for name, doc, value in counters:
        yield _family(CounterMetricFamily, name, doc, model, value)
    st = t.storage
    if st is None:
        return
    errors = {"read": st.read_errors, "write": st.write_errors, "corrupt": st.corrupt_pages}
    doc = "Storage failures by kind"
    yield _family(CounterMetricFamily, "kv_storage_errors", doc, model, errors, "kind")
    gauges = [
        ("kv_storage_stored_pages", "Pages in the store", st.stored_pages),
        ("kv_storage_used_bytes", "Bytes in the store", st.used_bytes),
        ("kv_storage_capacity_bytes", "The store's size cap", st.capacity_bytes),
    ]
    for name, doc, value in gauges:
        if value is not None:  # Redis knows neither cheaply: its server's business
            yield _family(GaugeMetricFamily, name, doc, model, value)


def cache_tiers(s: EngineStats) -> dict[str, Any] | None:
    """The tiers as ``/cache`` shows them (None without a host tier)."""
    if s.tiers is None:
        return None
    t = dataclasses.asdict(s.tiers)
    latency = s.tiers.load_latency
    t["load_latency"] = {"count": latency.count, "total_seconds": latency.total}
    return t


def pin_families(s: EngineStats, model: str) -> Iterator[Any]:
    """Pinned prefixes (``cache/pins.py``), while pins are on: tokens pinned in all and per
    tenant (the shared space is the tenant ``""``), the budget, and what happened to pins."""
    p = s.pins
    if p is None:
        return
    gauges = [
        ("radix_pinned_tokens", "Distinct tokens under a pin on the device", p.pinned_tokens),
        ("radix_pins", "Pinned prefixes", p.pins),
        ("radix_pin_budget_tokens", "Most tokens pins may hold", p.budget_tokens),
    ]
    for name, doc, value in gauges:
        yield _family(GaugeMetricFamily, name, doc, model, value)
    doc = "Distinct tokens under a pin of the tenant"
    yield _family(
        GaugeMetricFamily, "radix_pinned_tokens_by_tenant", doc, model, p.tenant_tokens, "tenant"
    )
    events = {
        "created": p.created,
        "refreshed": p.refreshed,
        "expired": p.expired,
        "demoted": p.demoted,
        "demoted_to_host": p.demoted_to_host,
        "refused_budget": p.refused_budget,
        "not_cached": p.not_cached,
        "unpinned": p.unpinned,
    }
    doc = "Pin events (see the label)"
    yield _family(CounterMetricFamily, "radix_pin_events", doc, model, events, "event")
