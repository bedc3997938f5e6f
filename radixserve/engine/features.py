"""The engine's own step features (``hooks.py``): tier transfers and the step record.

- ``TierTransfers``: moving pages between the cache tiers never blocks a step; before each
  schedule the finished moves are applied, and a step that could run nothing while requests
  wait (for pages on their way) waits a little for a move instead of spinning.
- ``StepRecord``: what the last step was, for the engine loop and the metrics: whether it
  ran nothing, how many cached tokens scheduling evicted, and (when an engine loop writes a
  step trace, ``step_trace.py``) its shape: prompt chunks as ``(tokens, position)`` and
  decode contexts.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.cache.base import PrefixCache
from radixserve.cache.lower_tiers import LowerTiers
from radixserve.engine.hooks import Feature
from radixserve.engine.scheduler import Step

IDLE_TRANSFER_WAIT_S = 0.01
StepShape = tuple[list[tuple[int, int]], list[int]]


class TierTransfers(Feature):
    def __init__(self, tiers: LowerTiers, has_waiting: Callable[[], bool]):
        self.tiers, self.has_waiting = tiers, has_waiting

    def before_schedule(self) -> None:
        self.tiers.poll()

    def after_schedule(self, step: Step) -> None:
        if step.empty and self.has_waiting():  # maybe waiting for pages: wait, not spin
            self.tiers.poll(timeout=IDLE_TRANSFER_WAIT_S)


class StepRecord(Feature):
    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.record_shape = False  # on while a step trace is written
        self.empty = False  # nothing could run: an engine loop may sleep a little
        self.evicted_tokens = 0  # by the last schedule, for the per-step eviction histogram
        self.shape: StepShape | None = None
        self._evicted_before = 0

    def before_schedule(self) -> None:
        self._evicted_before = self.cache.stats.evicted_tokens

    def after_schedule(self, step: Step) -> None:
        self.evicted_tokens = self.cache.stats.evicted_tokens - self._evicted_before
        self.empty = step.empty
        self.shape = None
        if self.record_shape and not step.empty:
            self.shape = (
                [(n, r.num_computed) for r, n in step.prefills],
                [r.num_computed for r in step.decodes],
            )
