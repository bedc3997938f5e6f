"""Fit the timing model to this engine: measure real steps, solve for the coefficients.

Method (``measure_steps``): a real ``Engine`` (the model, the KV pool, the native kernels: what
``radixserve serve`` runs) is driven through a plan that varies what steps compute:

1. prefill: prompts of 32 to ``max_len`` tokens behind cached prefixes of 0 to ``max_len / 2``
   tokens (chunked as the engine chunks them, so chunks start at many context positions);
2. decode: batches of 1 to 32 requests at contexts of 64 to ``max_len / 2`` tokens (sharing
   all but their last 16 prompt tokens, so the contexts are long but cheap to prefill);
3. mixed: a long prompt prefilling while a batch decodes.

With ``repeats`` > 1 the plan runs that often (same seed, so the same steps) and each step
composition keeps the minimum of its timings (``statistic="min"``: interference from other
processes only adds time) or the median.

Each ``engine.step()`` is timed whole (scheduling, forward, sampling, bookkeeping) and its
composition read from the shape the engine keeps of it (``Engine.last_step_shape``). The first
steps (kernel builds, allocator warm-up) are discarded. ``fit_coefficients`` then solves a
non-negative least-squares fit of relative error. The request overheads (time outside the
engine's steps) and the scale of the engine as it serves are measured on a real server by
``served.calibrate_served`` (``radixserve simulate fit --server``).

Host tier copies (``measure_tier_costs``): a host pool is built on the engine's own KV pool
and runs of 64, 256 and 1,024 tokens are copied device -> host (``HostKVPool.backup``, what
the tier controller does when it writes a node out) and back (``restore``, a load-back),
each timed ``repeats`` times, keeping the fastest; the cost per token is the sum of those
times over the sum of the tokens (so the per-copy overhead is spread as it is on runs of
those lengths).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from typing import Any

import numpy as np
import torch

from radixserve.cache.host_pool import HostKVPool
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.sim.timing import TimingModel, fit_coefficients, model_from_fit, step_features
from radixserve.utils import cpu_model

WARMUP_STEPS = 6
TIER_COPY_TOKENS = (64, 256, 1024)
# Prompt lengths, cached prefixes and decode contexts (fractions of ``max_len``), batches.
PLANS = {
    "full": dict(lengths=(32, 128, 512, 1024, 2048), cached=(0, 0.25, 0.5),
                 batches=(1, 4, 16, 32), contexts=(64, 0.25, 0.5), mixed=(4, 16)),
    "quick": dict(lengths=(32, 128, 512), cached=(0, 0.5), batches=(1, 4, 16),
                  contexts=(64, 0.5), mixed=(4,)),
}  # fmt: skip


def _record(engine: Engine, features: list, seconds: list) -> None:
    """Run ``engine`` to completion, timing every step and reading what it computed (the
    shape the engine keeps for a step trace, ``Engine.last_step_shape``)."""
    recording = engine.record_step_shape
    engine.record_step_shape = True
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            shape = engine.last_step_shape
            if shape is not None and (shape[0] or shape[1]):
                features.append(step_features(*shape))
                seconds.append(dt)
    finally:
        engine.record_step_shape = recording


def _add(engine: Engine, rng: np.random.Generator, prompt: np.ndarray, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(f"fit-{rng.integers(1 << 62)}", prompt.tolist(), params)


def measure_steps(
    engine: Engine, max_len: int = 2048, repeats: int = 1, seed: int = 0, plan: str = "full"
) -> tuple[np.ndarray, np.ndarray]:
    """(features, seconds) of the steps of the plan above (``PLANS``)."""
    p = PLANS[plan]
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    max_len = min(max_len, engine.max_model_len - 40, engine.allocator.num_slots // 40)
    features: list[np.ndarray] = []
    seconds: list[float] = []

    def tokens(n: int) -> np.ndarray:
        return rng.integers(3, vocab, n, dtype=np.int64)

    def size(x: float) -> int:
        return int(x * max_len) if x < 1 else int(x)

    lengths = [n for n in p["lengths"] if n <= max_len]
    for _ in range(repeats):
        for cached in map(size, p["cached"]):  # prefill behind cached prefixes
            base = tokens(cached)
            if cached:  # computed once, then hit by every prompt below
                _add(engine, rng, base, 1)
                _record(engine, [], [])
            for n in lengths:
                _add(engine, rng, np.concatenate([base, tokens(n)])[: max(max_len, n)], 2)
                _record(engine, features, seconds)
        for ctx in map(size, p["contexts"]):  # decode batches at several contexts
            shared = tokens(max(ctx - 16, 1))  # long contexts, little prefill: a shared prefix
            _add(engine, rng, shared, 1)
            _record(engine, [], [])
            for batch in p["batches"]:
                for _ in range(batch):
                    _add(engine, rng, np.concatenate([shared, tokens(16)]), 10)
                _record(engine, features, seconds)
        for batch in p["mixed"]:  # a long prefill next to a decoding batch
            for _ in range(batch):
                _add(engine, rng, tokens(64), 24)
            engine.step()
            _add(engine, rng, tokens(max_len // 2), 2)
            _record(engine, features, seconds)
        engine.flush_cache()
    return np.asarray(features[WARMUP_STEPS:]), np.asarray(seconds[WARMUP_STEPS:])


def aggregate_repeats(
    features: np.ndarray, seconds: np.ndarray, statistic: str = "min"
) -> tuple[np.ndarray, np.ndarray]:
    """One row per distinct step composition: the minimum (what the step costs with the
    machine to itself: interference only ever adds time) or the median of its timings."""
    groups: dict[tuple, list[float]] = {}
    for f, t in zip(features, seconds, strict=True):
        groups.setdefault(tuple(f), []).append(float(t))
    reduce = min if statistic == "min" else (lambda ts: float(np.median(ts)))
    keys = list(groups)
    return np.array(keys), np.array([reduce(groups[k]) for k in keys])


def fit_engine(
    engine: Engine,
    max_len: int = 2048,
    repeats: int = 1,
    seed: int = 0,
    statistic: str = "min",
    plan: str = "full",
) -> TimingModel:
    """Measure ``engine`` and fit a timing model (``request_overhead`` left at 0). With
    ``repeats`` > 1 each step composition is timed that often and reduced by ``statistic``."""
    t0 = time.perf_counter()
    features, seconds = aggregate_repeats(
        *measure_steps(engine, max_len, repeats, seed, plan), statistic
    )
    coef = fit_coefficients(features, seconds)
    predicted = features @ coef
    rel = np.abs(predicted - seconds) / seconds
    meta: dict[str, Any] = {
        "model": engine.model_name,
        "device": engine.config.device,
        "dtype": str(engine.pool.shape.dtype).removeprefix("torch."),
        "chunked_prefill_size": engine.config.scheduler.chunked_prefill_size,
        "machine": platform.machine(),
        "processor": cpu_model(),
        "threads": _threads(),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "steps": len(seconds),
        "median_relative_error": float(np.median(rel)),
        "p90_relative_error": float(np.percentile(rel, 90)),
        "fit_seconds": time.perf_counter() - t0,
        "repeats": repeats,
        "plan": plan,
        "statistic": statistic,
        "load_average": os.getloadavg()[0],
    }
    return dataclasses.replace(model_from_fit(coef, 0.0, meta),
                               **measure_tier_costs(engine, max(repeats, 3)))  # fmt: skip


def measure_tier_costs(engine: Engine, repeats: int = 5) -> dict[str, float]:
    """Seconds per token of copying KV device -> host (``host_write_token``) and host ->
    device (``host_load_token``) on ``engine``'s pool, and its ``kv_bytes_per_token``. The
    device slots copied are read and written back unchanged (the host copy is restored to
    the slots it came from), so the engine's cache is untouched."""
    pool, page = engine.pool, engine.allocator.page_size
    sizes = [-(-n // page) * page for n in TIER_COPY_TOKENS]
    host = HostKVPool(pool, max(sizes), page)
    write = load = 0.0
    for n in sizes:
        device_slots, host_slots = torch.arange(n), host.alloc(n)
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            t0 = time.perf_counter()
            host.backup(device_slots, host_slots)
            t1 = time.perf_counter()
            host.restore(host_slots, device_slots)
            t2 = time.perf_counter()
            best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
        write, load = write + best[0], load + best[1]
        host.free(host_slots)
    return {"host_write_token": write / sum(sizes), "host_load_token": load / sum(sizes),
            "kv_bytes_per_token": pool.shape.bytes_per_token()}  # fmt: skip


def _threads() -> int:
    import torch

    return torch.get_num_threads()
