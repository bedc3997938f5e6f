"""One simulated engine: the engine's own core with a timing model instead of the model.

``SimInstance`` builds the tree, the ledger and an ``EngineCore`` as ``Engine`` does, with
no KV tensors and no model; its executor (``TimingExecutor``) computes nothing: a step's
duration comes from the fitted timing model, and the token each request draws is the
trace's next output token, so the tree caches exactly what a real run would. Scheduling,
committing, publishing, stopping and finishing are the core's, the same code the server runs.

Pure-decode runs. When nobody waits and every running request is decoding, ``schedule()``
does the same thing step after step: one slot per request, a decay of the output
reservation ratio. Such a run of ``k`` steps (``k`` up to the first finish, and no more than
the memory obtainable now, ``EngineCore.decode_run_length``) is applied in one go
(``EngineCore.advance_decodes``), its step times summed in closed form; a request routed
here mid-run cuts it at the step boundary after its arrival, where the real engine would
admit it. This keeps 1,000 instances x 100,000 requests within minutes.

Sliding-window layers. Given the model's KV geometry (``kv_shape`` with ``window_layers``,
``sliding_window`` tokens), the instance keeps the window layers' KV apart as the server
does (``build_allocator``: window pages for ``window_kv_share`` of the slots, tombstoned in
the tree where no resume point needs them), so hits and tombstones are the server's.

The host tier. With ``host_kv_memory`` the instance builds the server's own tree and
``TierController`` (``engine/cache_setup.py``: the same sizing) over a ``SimHostPool`` (slots,
no KV), and holds the controller as the engine does. The pages the controller copied since
the last planned step (written out on insert or eviction, loaded back on admission) cost that
step ``TimingModel.transfer_time``; a pure-decode run's copies are charged to the step after
it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from radixserve.cache import NO_TIERS, KVEventQueue, LowerTiers, PagedAllocator, PrefixCache
from radixserve.cache.eviction_base import EvictionPolicy
from radixserve.cache.kv_pool import KVShape
from radixserve.config import EngineConfig
from radixserve.engine.cache_setup import (
    build_allocator,
    device_cache,
    host_slots,
    is_tiered,
    tiered_cache,
    window_share,
)
from radixserve.engine.core import EngineCore, Limits, StepOutput, StepResult
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.request import Request, Usage
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import Step
from radixserve.engine.spec import RequestSpec
from radixserve.sim.host import SimHostPool
from radixserve.sim.timing import TimingModel, step_features

NO_CONTEXT_LIMIT = 2**62  # a simulated instance is bounded by its pool alone


class TimingExecutor:
    """The simulator's executor: a step takes the timing model's time, and each request
    draws the next token of its known output."""

    def __init__(self, timing: TimingModel):
        self.timing = timing
        self.outputs: dict[str, np.ndarray] = {}  # request id -> the output it will draw

    def duration(self, step: Step) -> float:
        feats = step_features(
            [(n, r.num_computed) for r, n in step.prefills], [r.num_computed for r in step.decodes]
        )
        return float(feats @ self.timing.coefficients())

    def run(self, step: Step) -> StepResult:
        return StepResult([(r, (int(self.next_tokens(r, 1)[0]), None)) for r in step.sampling()])

    def next_tokens(self, req: Request, k: int) -> np.ndarray:
        k0 = req.num_output
        return self.outputs[req.request_id][k0 : k0 + k]

    def forget(self, request_id: str) -> None:
        del self.outputs[request_id]


class SimInstance:
    def __init__(
        self,
        index: int,
        config: EngineConfig,
        timing: TimingModel,
        events: bool = False,
        policy_factory: Callable[[PagedAllocator], object] | None = None,
        decode_runs: bool = True,
        kv_shape: KVShape | None = None,
        sliding_window: int = 0,
    ):
        if config.cache.max_total_tokens is None:
            raise ValueError("a simulated instance needs max_total_tokens (its KV pool)")
        self.index = index
        self.decode_runs = decode_runs  # False: every step through schedule() (for tests)
        self.config = config
        self.timing = timing
        tokens, page = config.cache.max_total_tokens, config.cache.page_size
        if kv_shape is None:
            self.allocator = PagedAllocator(tokens, page)
        else:  # window layers apart as the server keeps them
            share = window_share(config, kv_shape)
            self.allocator = build_allocator(config, tokens, sliding_window, share)
        self.events = KVEventQueue(maxlen=1 << 30) if events else None
        policy = policy_factory(self.allocator) if policy_factory else None
        self.cache, self.tiers, self.host = sim_cache(
            config, self.allocator, self.events, timing, policy
        )
        self._moved = (0, 0)  # host pages loaded, written, as of the last charged step
        self.transfer_time = 0.0  # seconds of steps spent copying between tiers
        self.kv = RequestKV(self.cache, self.allocator, self.tiers)
        self.core = EngineCore(config, self.kv, Limits(NO_CONTEXT_LIMIT))
        self.scheduler = self.core.scheduler
        self.executor = TimingExecutor(timing)
        self._params: dict[int, SamplingParams] = {}  # by output length
        self._tags: dict[str, Any] = {}
        self.busy = False
        self.version = 0  # bumps when a planned step end moves (a cut run)
        self._step: Step | None = None
        self._run: tuple[float, np.ndarray, int] | None = None  # (start, step ends, steps)
        self.busy_time = 0.0
        self.steps = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.served = 0

    # ------------------------------------------------------------------ requests
    def fits(self, prompt_len: int, output_len: int) -> bool:
        pages = -(-(prompt_len + max(output_len, 1)) // self.allocator.page_size)
        return pages <= self.allocator.num_pages

    def add(
        self, request_id: str, prompt: np.ndarray, output: np.ndarray, namespace, tag: Any
    ) -> None:
        """Queue a request whose output is known; ``tag`` comes back when it progresses."""
        if not len(output):
            output = np.zeros(1, np.int32)
        params = self._params.get(len(output))
        if params is None:
            params = SamplingParams(max_tokens=len(output), temperature=0.0, seed=0)
            self._params[len(output)] = params
        self.executor.outputs[request_id] = output
        self._tags[request_id] = tag
        self.core.add(RequestSpec(request_id=request_id, prompt_ids=prompt, params=params,
                                  namespace=namespace))  # fmt: skip

    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------------ steps
    def start_step(self, now: float) -> float | None:
        """Plan the next step (or pure-decode run); return when it ends, None if idle."""
        self._step, self._run = None, None
        if self.decode_runs:
            # (a request with no output yet times its first token: one step alone)
            k = self.core.decode_run_length(2**62)
            if k >= 2:
                running = self.scheduler.running
                ctx = sum(r.num_computed for r in running)
                ends = self.timing.decode_run(len(running), ctx, k) + self._transfers()
                self._run = (now, ends, k)
                return self._begin(now, float(ends[-1]))
        step = self.core.schedule()
        if step.empty:
            self.busy = False
            return None
        self._step = step
        return self._begin(now, self.executor.duration(step) + self._transfers())

    def _transfers(self) -> float:
        """Seconds of the tier copies made since the last step that was charged for them."""
        if self.host is None:
            return 0.0
        moved = (self.host.stats.pages_to_device, self.host.stats.pages_to_host)
        loaded, written = (self.allocator.page_size * (a - b)
                           for a, b in zip(moved, self._moved, strict=True))  # fmt: skip
        self._moved = moved
        seconds = self.timing.transfer_time(loaded, written)
        self.transfer_time += seconds
        return seconds

    def _begin(self, now: float, duration: float) -> float:
        self.busy = True
        self.busy_time += duration
        self._started = now
        return now + duration

    def cut_run(self, now: float) -> float | None:
        """A request arrived at ``now`` during a pure-decode run: end the run at the first step
        boundary at or after ``now``; return the new end time (None if nothing changes)."""
        if self._run is None:
            return None
        start, ends, k = self._run
        j = int(np.searchsorted(ends, now - start, side="left")) + 1
        if j >= k:
            return None
        self.busy_time -= float(ends[-1] - ends[j - 1])
        self._run = (start, ends[:j], j)
        self.version += 1
        return start + float(ends[j - 1])

    def end_step(self) -> tuple[list[Any], list[tuple[Any, Usage]]]:
        """Apply the planned step; return the tags of the requests that got their first
        token, and the tags and usage of those that finished."""
        self.steps += 1
        if self._run is not None:
            _, _, k = self._run
            self.decode_tokens += k * len(self.scheduler.running)
            first = []
            outputs = self.core.advance_decodes(k, self.executor.next_tokens)
        else:
            step = self._step
            self.prefill_tokens += sum(n for _, n in step.prefills)
            self.decode_tokens += len(step.decodes)
            result = self.executor.run(step)
            first = [self._tags[r.request_id] for r, _ in result.sampled if r.num_output == 0]
            outputs = self.core.postprocess(step, result)
        return first, self._finished(outputs)

    def _finished(self, outputs: list[StepOutput]) -> list[tuple[Any, Usage]]:
        done = []
        for out in outputs:
            if out.finished:
                self.executor.forget(out.request_id)
                done.append((self._tags.pop(out.request_id), out.usage))
                self.served += 1
        return done

    def check_integrity(self) -> None:
        self.core.check_integrity()


def sim_cache(
    config: EngineConfig,
    allocator: PagedAllocator,
    events: KVEventQueue | None,
    timing: TimingModel,
    policy: EvictionPolicy | None = None,
) -> tuple[PrefixCache, LowerTiers, SimHostPool | None]:
    """A simulated instance's cache and the tiers below it, built as the server builds its
    own, and its host pool (None without a host tier)."""
    slots = host_tier_slots(config, timing)
    if slots is None:
        return device_cache(config, allocator, events, policy), NO_TIERS, None
    host = SimHostPool(slots, allocator.page_size, timing.kv_bytes_per_token)
    cache, tiers = tiered_cache(config, allocator, host, events, policy)
    return cache, tiers, host


def host_tier_slots(config: EngineConfig, timing: TimingModel) -> int | None:
    """The host tier's size in tokens (None: no host tier): ``host_kv_memory`` over the
    timing model's ``kv_bytes_per_token``. A ValueError names what is wrong."""
    if config.tiers.kv_storage is not None:
        raise ValueError("the simulator models a host tier (host_kv_memory), not kv_storage")
    if not is_tiered(config):
        return None
    if not timing.kv_bytes_per_token:
        raise ValueError(
            "host_kv_memory needs the timing model's kv_bytes_per_token (a profile from "
            "`radixserve simulate fit` has it)"
        )
    device = config.cache.max_total_tokens or 0
    return host_slots(config, device, timing.kv_bytes_per_token)
