"""The discrete-event loop: sessions arrive, the router places each turn, instances step.

Events, in time order (ties in the order they were made):

- a session starts: by the trace's timestamp, a Poisson process (``session_rate``), or, for
  an untimed trace with neither, as soon as fewer than ``max_concurrency`` sessions are in
  flight (a closed loop, as ``radixserve bench`` runs);
- a turn arrives: the router picks an instance, the request joins its waiting queue, and an
  idle instance starts a step once every arrival of that same instant is queued (as the
  engine drains its inbox before stepping); a busy one admits it at its next step boundary;
- a step ends: the instance applies it (``SimInstance.end_step``), its KV events leave for the
  router, finished turns schedule the session's next turn ``request_overhead + think time``
  later, and the instance starts its next step;
- KV events reach the router (after ``event_delay``; a lost batch never does).

Times are seconds. A request's TTFT and latency are measured from its arrival at the engine
plus its time outside the engine (``TimingModel.outside_time`` of its prompt and the requests
already in flight at its instance: the client-side round trip, tokenizing, the front end's
streaming).
A turn whose prompt and output cannot fit one instance's pool fails, as the engine would
refuse it, and ends its session.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.cache.kv_pool import KVShape
from radixserve.config import EngineConfig
from radixserve.sim.instance import SimInstance
from radixserve.sim.routing import RoutingConfig, SimRouter
from radixserve.sim.timing import TimingModel
from radixserve.sim.trace import Trace

START, ARRIVE, STEP_END, EVENTS, KICK = range(5)


@dataclass
class SimConfig:
    engine: EngineConfig  # one instance's; max_total_tokens is its KV pool
    instances: int = 1
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    max_concurrency: int | None = None  # closed loop: sessions in flight (untimed traces)
    session_rate: float | None = None  # open loop: Poisson session starts per second
    seed: int = 0
    check_integrity: bool = False  # check every instance's tree and pool at the end
    # >1: this one instance stands for that many pooled (their KV and running requests are in
    # ``engine``; its steps run that many times faster): the optimum routing is compared with
    pooled: int = 1
    # the model's KV geometry (None: not modelled); with sliding-window layers
    # (``kv_shape.window_layers``, ``sliding_window`` tokens) their KV is kept apart as the
    # server keeps it (``window_kv_share``), and the summary reports the KV bytes in use
    kv_shape: KVShape | None = None
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.instances, int) or self.instances < 1:
            raise ValueError(f"instances must be a positive integer, got {self.instances!r}")
        if self.pooled > 1 and self.instances != 1:
            raise ValueError("a pooled configuration is one instance")
        if self.engine.cache.max_total_tokens is None:
            raise ValueError("max_total_tokens (the KV pool per instance) is required")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.session_rate is not None and not self.session_rate > 0:
            raise ValueError(f"session_rate must be > 0, got {self.session_rate}")


@dataclass
class Records:
    """One row per request, in arrival order (numpy arrays after ``finalize``)."""

    arrival: Any = field(default_factory=list)
    first_token: Any = field(default_factory=list)
    finish: Any = field(default_factory=list)
    prompt_len: Any = field(default_factory=list)
    cached: Any = field(default_factory=list)
    host_cached: Any = field(default_factory=list)  # of ``cached``: loaded from the host tier
    output_len: Any = field(default_factory=list)
    instance: Any = field(default_factory=list)
    turn: Any = field(default_factory=list)
    session: Any = field(default_factory=list)  # index into the trace's sessions
    outside: Any = field(default_factory=list)  # seconds outside the engine (added to TTFT)

    def add(
        self,
        arrival: float,
        prompt_len: int,
        output_len: int,
        instance: int,
        turn: int,
        session: int = -1,
        outside: float = 0.0,
    ) -> int:
        for name, value in (("arrival", arrival), ("first_token", math.nan), ("finish", math.nan),
                            ("prompt_len", prompt_len), ("cached", 0), ("host_cached", 0),
                            ("output_len", output_len),
                            ("instance", instance), ("turn", turn),
                            ("session", session), ("outside", outside)):  # fmt: skip
            getattr(self, name).append(value)
        return len(self.arrival) - 1

    def finalize(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, np.asarray(getattr(self, name)))


@dataclass
class SimResult:
    config: SimConfig
    trace: Trace
    timing: TimingModel
    records: Records
    instances: list[SimInstance]
    router: SimRouter
    end_time: float
    failed: int
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time: the speed on an otherwise idle machine


class Simulation:
    def __init__(
        self, trace: Trace, config: SimConfig, timing: TimingModel, decode_runs: bool = True
    ):
        if config.pooled > 1:
            timing = timing.scaled(1 / config.pooled)
        self.trace, self.config, self.timing = trace, config, timing
        if not trace.timed and config.session_rate is None and config.max_concurrency is None:
            raise ValueError(
                f"the {trace.name} trace has no timestamps: give max_concurrency (sessions in "
                "flight, a closed loop) or session_rate (Poisson session starts per second)"
            )
        events = config.routing.uses_events and config.instances > 1
        self.instances = [
            SimInstance(
                i,
                config.engine,
                timing,
                events,
                decode_runs=decode_runs,
                kv_shape=config.kv_shape,
                sliding_window=config.sliding_window,
            )
            for i in range(config.instances)
        ]
        for instance in self.instances:
            instance.cache.set_turn_end_ids(trace.turn_end_ids)
        block = self.instances[0].cache.event_block_size if events else 16
        self.router = SimRouter(config.routing, config.instances, block)
        self.records = Records()
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.failed = 0
        self._in_flight = 0
        self._next_session = 0
        self._timed = trace.timed
        self._closed = not self._timed and config.session_rate is None

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    # ------------------------------------------------------------------ sessions
    def _schedule_sessions(self) -> None:
        sessions, cfg = self.trace.sessions, self.config
        if self._timed:
            for i, s in enumerate(sessions):
                self._push(float(s.arrival), START, i)
        elif cfg.session_rate is not None:
            rng = np.random.default_rng(cfg.seed)
            gaps = rng.exponential(1.0 / cfg.session_rate, len(sessions))
            for i, t in enumerate(np.concatenate([[0.0], np.cumsum(gaps[:-1])])):
                self._push(float(t), START, i)
        else:
            self._next_session = min(cfg.max_concurrency, len(sessions))
            for i in range(self._next_session):
                self._push(0.0, START, i)

    def _session_done(self, t: float, session_index: int) -> None:
        self._in_flight -= 1
        self.router.forget_session(self.trace.sessions[session_index].id)
        if self._closed and self._next_session < len(self.trace.sessions):
            self._push(t, START, self._next_session)
            self._next_session += 1

    # ------------------------------------------------------------------ events
    def _arrive(self, t: float, session_index: int, k: int) -> None:
        session = self.trace.sessions[session_index]
        turn = session.turns[k]
        inst0 = self.instances[0]
        if not inst0.fits(len(turn.prompt), len(turn.output)):
            self.failed += 1
            self._session_done(t, session_index)
            return
        i, ticket = self.router.route(turn.prompt, session.namespace, session.id, t)
        inst = self.instances[i]
        outside = self.timing.outside_time(len(turn.prompt), inst.load() / self.config.pooled)
        row = self.records.add(t, len(turn.prompt), len(turn.output), i, k, session_index, outside)
        tag = (row, session_index, k, ticket)
        inst.add(str(row), turn.prompt, turn.output, session.namespace, tag)
        if not inst.busy:
            inst.busy = True  # until the kick: later arrivals of this instant just queue
            self._push(t, KICK, inst.index)
        else:
            end = inst.cut_run(t)
            if end is not None:
                self._push(end, STEP_END, (inst.index, inst.version))

    def _start(self, t: float, inst: SimInstance) -> None:
        end = inst.start_step(t)
        if end is not None:
            self._push(end, STEP_END, (inst.index, inst.version))

    def _step_end(self, t: float, inst: SimInstance) -> None:
        first, finished = inst.end_step()
        rec, overhead = self.records, self.timing.request_overhead
        if inst.events is not None and len(inst.events):
            batch = inst.events.drain()
            if self.router.keep_batch():
                delay = self.config.routing.event_delay
                if delay == 0:
                    self.router.apply_events(inst.index, batch)
                else:
                    self._push(t + delay, EVENTS, (inst.index, batch))
        for tag in first:
            rec.first_token[tag[0]] = t
            self.router.first_token(tag[3], t)
        for (row, si, k, ticket), usage in finished:
            rec.finish[row] = t
            rec.cached[row] = usage.cached_tokens
            rec.host_cached[row] = usage.host_cached_tokens
            self.router.finish(ticket, usage.cached_tokens, t)
            turns = self.trace.sessions[si].turns
            if k + 1 < len(turns):
                self._push(t + overhead + turns[k + 1].think_time, ARRIVE, (si, k + 1))
            else:
                self._session_done(t, si)
        self._start(t, inst)

    def run(self) -> SimResult:
        import time

        wall, cpu = time.perf_counter(), time.process_time()
        self._schedule_sessions()
        t = 0.0
        heap, instances = self._heap, self.instances
        while heap:
            t, _, kind, payload = heapq.heappop(heap)
            if kind == STEP_END:
                i, version = payload
                if instances[i].version == version:
                    self._step_end(t, instances[i])
            elif kind == ARRIVE:
                self._arrive(t, *payload)
            elif kind == START:
                self._in_flight += 1
                self._arrive(t, payload, 0)
            elif kind == KICK:
                self._start(t, instances[payload])
            else:
                self.router.apply_events(*payload)
        if self.config.check_integrity:
            for inst in instances:
                inst.check_integrity()
        self.records.finalize()
        return SimResult(self.config, self.trace, self.timing, self.records, instances,
                         self.router, t, self.failed, time.perf_counter() - wall,
                         time.process_time() - cpu)  # fmt: skip
