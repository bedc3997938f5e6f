"""What a simulation reports: hit rate, prefill saved, latency percentiles, load, evictions.

``hit_rate`` is the bench's: prompt tokens served from the cache at a request's first
admission over all prompt tokens. TTFT and latency include each request's time outside the
engine (``TimingModel.outside_time``). Load imbalance is max / mean over instances, of busy
time (what an instance computes) and of requests served.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from radixserve.sim.loop import SimResult


def percentile(values: np.ndarray, q: float) -> float | None:
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else None


def imbalance(values: list[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean > 0 else None


def summarize(result: SimResult) -> dict[str, Any]:
    rec, cfg = result.records, result.config
    done = ~np.isnan(rec.finish) if len(rec.arrival) else np.zeros(0, bool)
    overhead = rec.outside[done]
    ttft = rec.first_token[done] - rec.arrival[done] + overhead
    latency = rec.finish[done] - rec.arrival[done] + overhead
    prompt = int(rec.prompt_len[done].sum()) if len(rec.arrival) else 0
    cached = int(rec.cached[done].sum()) if len(rec.arrival) else 0
    busy = [inst.busy_time for inst in result.instances]
    served = [inst.served for inst in result.instances]
    stats = [inst.cache.stats for inst in result.instances]
    makespan = result.end_time
    engine = cfg.engine
    return {
        "trace": result.trace.name,
        "instances": cfg.pooled if cfg.pooled > 1 else cfg.instances,
        "kv_tokens_per_instance": engine.cache.max_total_tokens // cfg.pooled,
        "page_size": engine.cache.page_size,
        "eviction_policy": result.instances[0].cache.eviction_policy
        if engine.cache.enable_prefix_caching
        else "none",
        "schedule_policy": engine.scheduler.schedule_policy,
        **host_tier(result),
        **window_layers(result),
        "routing": "pooled optimum" if cfg.pooled > 1 else cfg.routing.policy,
        "requests": int(done.sum()),
        "requests_failed": result.failed,
        # still waiting when every event was handled: an engine that could never admit them
        "requests_stuck": int((~done).sum()),
        "hit_rate": cached / prompt if prompt else None,
        "prompt_tokens": prompt,
        "prefill_tokens_saved": cached,
        "prefill_tokens_computed": sum(inst.prefill_tokens for inst in result.instances),
        "decode_tokens": sum(inst.decode_tokens for inst in result.instances),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
        "makespan_s": makespan,
        "requests_per_s": int(done.sum()) / makespan if makespan > 0 else None,
        "load_imbalance_busy": imbalance(busy),
        "load_imbalance_requests": imbalance([float(s) for s in served]),
        "busy_s_max": max(busy),
        "busy_s_mean": sum(busy) / len(busy),
        "evicted_tokens": sum(s.evicted_tokens for s in stats),
        "evicted_nodes": sum(s.evictions for s in stats),
        "retractions": sum(inst.scheduler.num_retractions for inst in result.instances),
        "router": result.router.stats() if cfg.instances > 1 else None,
        "wall_s": result.wall_seconds,
        "cpu_s": result.cpu_seconds,
    }


def host_tier(result: SimResult) -> dict[str, Any]:
    """The host tier's part: its size, write policy, the prompt tokens it served and the
    copies it cost (empty without a host tier)."""
    hosts = [inst.host for inst in result.instances if inst.host is not None]
    if not hosts:
        return {}
    rec, done = result.records, ~np.isnan(result.records.finish)
    page = result.instances[0].allocator.page_size
    return {
        "host_kv_tokens_per_instance": hosts[0].num_slots,
        "write_policy": result.config.engine.tiers.write_policy,
        "host_cached_tokens": int(rec.host_cached[done].sum()),
        "host_loaded_tokens": sum(h.stats.pages_to_device for h in hosts) * page,
        "host_written_tokens": sum(h.stats.pages_to_host for h in hosts) * page,
        "host_transfer_s": sum(inst.transfer_time for inst in result.instances),
    }


def window_layers(result: SimResult) -> dict[str, Any]:
    """With the model's KV geometry (``SimConfig.kv_shape``): the KV bytes in use at the end
    per cached token, also as a share of keeping every layer's KV (the global layers' KV of
    the main slots in use plus the window layers' KV of the window slots in use, over the
    tokens the trees cache; with one pool, every layer's KV of the slots in use), and the
    window KV tombstoned. Empty without a shape."""
    shape = result.config.kv_shape
    if shape is None:
        return {}
    layer, local = shape.layer_bytes(), len(shape.window_layers)
    in_use = cached = tombstoned = window_slots = 0
    for inst in result.instances:
        a = inst.allocator
        used = a.num_slots - a.free_size()
        cached += inst.cache.total_size()
        if a.windowed:
            window_used = a.window_slots - a.window_free_size()
            in_use += (used * (shape.num_layers - local) + window_used * local) * layer
            window_slots += a.window_slots
            tombstoned += inst.cache.windows.tombstoned_tokens
        else:
            in_use += used * shape.bytes_per_token()
    return {
        "window_kv_tokens_per_instance": window_slots // len(result.instances),
        "window_tokens_tombstoned": tombstoned,
        "kv_bytes_per_cached_token": in_use / cached if cached else None,
        "kv_bytes_vs_all_layers": in_use / (cached * shape.bytes_per_token()) if cached else None,
    }


def finite(x: Any) -> Any:
    """JSON has no NaN or infinity: None instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
