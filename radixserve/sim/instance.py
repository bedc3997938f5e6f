"""One simulated engine: the real tree, ledger and scheduler; a timing model for the model.

``SimInstance`` builds what ``Engine`` builds (``PagedAllocator``, ``RadixCache`` with the
configured eviction policy, ``RequestKV``, ``Scheduler``) with no KV tensors and no model, and
does per step what ``Engine.step`` does around the forward pass: schedule, commit what the
step computed, publish finished prefill chunks to the tree, append one token per sampled
request, finish requests at their output length. The tokens appended are the trace's, so the
tree caches exactly what a real run would.

Pure-decode runs. When nobody waits and every running request is decoding, ``schedule()``
does the same thing step after step: one slot per request, a decay of the output
reservation ratio. Such a run of ``k`` steps (``k`` up to the first finish, and no more than
the memory obtainable now) is simulated in one go, its step times summed in closed form; a
request routed here mid-run cuts it at the step boundary after its arrival, where the real
engine would admit it. This keeps 1,000 instances x 100,000 requests within minutes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from radixserve.cache import KVEventQueue, NullCache, PagedAllocator, RadixCache
from radixserve.config import EngineConfig
from radixserve.engine import scheduler as sched
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.sampling_params import SamplingParams
from radixserve.sim.timing import TimingModel, step_features

PARAMS = SamplingParams(temperature=0.0)


class SimRequest(Request):
    """A request whose output tokens are known: ``output`` is appended token by token."""

    def __init__(self, request_id: str, prompt: np.ndarray, output: np.ndarray, extra_key, arrival):
        super().__init__(request_id, prompt, PARAMS, max(len(output), 1), 0, extra_key, arrival)
        self.output = output if len(output) else np.zeros(1, np.int32)
        self.tag = None  # whatever the event loop attaches (its own record)

    def append_outputs(self, n: int) -> None:
        k = self.num_output
        self._ids[self.num_tokens : self.num_tokens + n] = self.output[k : k + n]
        self.num_tokens += n


class SimInstance:
    def __init__(
        self,
        index: int,
        config: EngineConfig,
        timing: TimingModel,
        events: bool = False,
        policy_factory: Callable[[PagedAllocator], object] | None = None,
        decode_runs: bool = True,
    ):
        if config.max_total_tokens is None:
            raise ValueError("a simulated instance needs max_total_tokens (its KV pool)")
        self.index = index
        self.decode_runs = decode_runs  # False: every step through schedule() (for tests)
        self.config = config
        self.timing = timing
        self.allocator = PagedAllocator(config.max_total_tokens, config.page_size)
        self.events = KVEventQueue(maxlen=1 << 30) if events else None
        if not config.enable_prefix_caching:
            self.cache = NullCache(self.allocator)
        else:
            policy = policy_factory(self.allocator) if policy_factory else config.eviction_policy
            self.cache = RadixCache(
                self.allocator, policy, self.events, cache_threshold=config.cache_threshold
            )
        self.kv = RequestKV(self.cache, self.allocator)
        self.scheduler = sched.Scheduler(config, self.kv)
        self._arrivals = 0
        self.busy = False
        self.version = 0  # bumps when a planned step end moves (a cut run)
        self._step: sched.Step | None = None
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

    def add(self, req: SimRequest) -> None:
        req.arrival = self._arrivals
        self._arrivals += 1
        self.scheduler.add(req)

    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------------ steps
    def start_step(self, now: float) -> float | None:
        """Plan the next step (or pure-decode run); return when it ends, None if idle."""
        s = self.scheduler
        self._step, self._run = None, None
        if (
            self.decode_runs
            and not s.waiting
            and s.running
            and all(r.is_decoding and r.num_output for r in s.running)
        ):  # (a request with no output yet times its first token: one step alone)
            batch = len(s.running)
            k = min(r.remaining_output for r in s.running)
            # each request may need one page more than its k slots
            k = min(k, (self.kv.available() - batch * self.allocator.page_size) // batch)
            if k >= 2:
                ctx = sum(r.num_computed for r in s.running)
                ends = self.timing.decode_run(len(s.running), ctx, k)
                self._run = (now, ends, k)
                return self._begin(now, float(ends[-1]))
        step = s.schedule()
        if step.empty:
            self.busy = False
            return None
        self._step = step
        feats = step_features(
            [(n, r.num_computed) for r, n in step.prefills], [r.num_computed for r in step.decodes]
        )
        return self._begin(now, float(feats @ self.timing.coefficients()))

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

    def end_step(self) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply the planned step; return (requests that got their first token, finished)."""
        self.steps += 1
        if self._run is not None:
            return self._end_run()
        step, kv = self._step, self.kv
        assert step is not None
        sampled = list(step.decodes)
        for r in step.decodes:
            kv.commit(r, 1)
        for r, n in step.prefills:
            kv.commit(r, n)
            kv.publish(r)
            self.prefill_tokens += n
            if r.num_computed == r.num_tokens:
                sampled.append(r)
        self.decode_tokens += len(step.decodes)
        return self._emit(sampled, 1)

    def _end_run(self) -> tuple[list[SimRequest], list[SimRequest]]:
        _, _, k = self._run
        s, kv = self.scheduler, self.kv
        running = list(s.running)
        for r in running:
            if not kv.extend(r, k):  # cannot happen: k was bounded by what was obtainable
                raise RuntimeError(f"{r!r}: a planned decode run found no memory")
            kv.commit(r, k)
        s.new_token_ratio = max(
            sched.MIN_NEW_TOKEN_RATIO, s.new_token_ratio - k * sched.NEW_TOKEN_RATIO_DECAY
        )
        self.decode_tokens += k * len(running)
        return self._emit(running, k)

    def _emit(self, sampled: list, k: int) -> tuple[list[SimRequest], list[SimRequest]]:
        first, finished = [], []
        for r in sampled:
            if r.num_output == 0:
                first.append(r)
            r.append_outputs(k)
            if r.num_output >= r.max_tokens:
                self.scheduler.finish(r, "length")
                finished.append(r)
                self.served += 1
        return first, finished

    def check_integrity(self) -> None:
        running = [r for r in self.scheduler.running if r.status is RequestStatus.RUNNING]
        self.kv.check_integrity(running)
