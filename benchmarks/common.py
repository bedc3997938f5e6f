"""Helpers shared by the benchmark scripts: a median timer and the machine's CPU model."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from radixserve.utils import cpu_model

__all__ = ["cpu_model", "median_seconds"]


def median_seconds(
    fn: Callable[[], object],
    repeat: int = 1,
    setup: Callable[[], object] | None = None,
    warmup: int = 0,
) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs after ``warmup`` untimed ones;
    ``setup`` runs before each, outside the timing."""
    samples = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
