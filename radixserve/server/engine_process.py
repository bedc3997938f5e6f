"""The engine process: runs the step loop, talks to the HTTP process over ZeroMQ.

Messages in and out are the typed ones of ``messages.py``: requests arrive as ``RequestSpec``
values inside an ``AddRequest`` (all of one HTTP request's, taken together or not at all),
outputs leave in an ``Outputs`` after every step.

New messages are read between steps: the loop never blocks while requests are running, and
sleeps on the socket when idle. In a disaggregation mode it also wakes on KV transfer
traffic (``Engine.wake_fd``), and while every request waits for transferred KV it sleeps
between looks instead of spinning. ``stats`` is an ``EngineStats`` snapshot (the engine's typed
boundary), which the HTTP side turns into metrics.

With ``EngineConfig.step_trace`` (``serve --step-trace PATH``) the loop writes every
admission and every step, timed whole, to that file (``engine/step_trace.py``).

The loop never dies on one message: a message that cannot be read or handled is logged with
its traceback and answered with a short error for that request alone. A step that raises
(the engine isolates the errors of its forward pass itself; this is the net below it) ends
every unfinished request with ``finish_reason="error"``; if the slot ledger is then no longer
whole, the process exits with ``EXIT_CORRUPT`` so the HTTP side starts a fresh engine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import time
import traceback
from typing import Any

import zmq

from radixserve.cache.base import TreeSummary
from radixserve.cache.storage import ClearResult
from radixserve.config import EngineConfig
from radixserve.disagg import Disaggregation
from radixserve.engine import Engine
from radixserve.engine.spec import RequestSpec
from radixserve.engine.stats import EngineStats
from radixserve.engine.step_trace import StepTraceWriter, TierTrace
from radixserve.kvevents.publisher import KVEventPublisher
from radixserve.server.event_bridge import EventBridge
from radixserve.server.messages import (
    Abort,
    Added,
    AddRequest,
    Fatal,
    Outputs,
    Ready,
    Rejected,
    Rpc,
    RpcReply,
    Shutdown,
    ToEngine,
    decode,
)

IDLE_POLL_MS = 200
WAITING_POLL_MS = 20  # requests exist but none could run (their KV is on its way)
PR_SET_PDEATHSIG = 1
EXIT_CORRUPT = 3
STEP_ERROR = "the engine failed while computing this request; the details are in the server log"
ADD_ERROR = "the engine could not take this request; the details are in the server log"

log = logging.getLogger("radixserve.engine")


class _Shutdown(Exception):
    pass


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        pull: zmq.Socket,
        push: zmq.Socket,
        events: EventBridge | None = None,
        trace: StepTraceWriter | None = None,
    ):
        self.engine, self.pull, self.push = engine, pull, push
        self.events = events
        self.trace = trace  # --step-trace: every step and admission, timed (step_trace.py)
        self._tiers_before: Any = None  # the tiers' counters at the last traced step
        engine.record_step_shape = trace is not None
        self._streaming: set[str] = set()  # traced requests that have had a token
        self._counts: tuple[int, int, int] | None = None  # (running, waiting, loading) sent

    def handle(self, msg: ToEngine) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, Abort):
            out = self.engine.abort_request(msg.request_id, msg.reason)
            self._streaming.discard(msg.request_id)
            if out is not None:
                self.push.send_pyobj(Outputs([out], self.engine.stats(), False))
        elif isinstance(msg, Shutdown):
            raise _Shutdown
        elif isinstance(msg, Rpc):
            try:  # report to the caller; the loop goes on
                value, ok = getattr(self, f"rpc_{msg.name}")(**msg.kwargs), True
            except Exception as e:
                value, ok = f"{type(e).__name__}: {e}", False
            self.push.send_pyobj(RpcReply(msg.call_id, ok, value, self.engine.stats()))
        else:
            raise ValueError(f"unknown message {msg!r}")

    def _add(self, msg: AddRequest) -> None:
        """Admit every request of ``msg``, or none: one refused drops those already taken."""
        ids = [spec.request_id for spec in msg.specs]
        received = time.monotonic()
        for i, spec in enumerate(msg.specs):
            if self.trace is not None:
                self.trace.added(spec.request_id, msg.sent_at, received)
            error = self._add_one(spec)
            if error is not None:
                for rid in ids[:i]:
                    self._forget(rid, "abort")
                self.push.send_pyobj(Rejected(ids, i, error))
                return
        self.push.send_pyobj(Added(ids))

    def _add_one(self, spec: RequestSpec) -> str | None:
        """Admit one request; the reason it was refused, or None."""
        try:
            self.engine.add(spec)
        except ValueError as e:
            return str(e)
        except Exception:
            log.exception("request %s could not be added", spec.request_id)
            self._forget(spec.request_id)
            return ADD_ERROR
        return None

    def _forget(self, rid: str, reason: str = "error") -> None:
        """Drop request ``rid``, or what a failed ``add`` may have left of it (its final
        output goes nowhere: its sender has given it up)."""
        if rid in self.engine.requests:
            try:
                self.engine.abort_request(rid, reason)
            except Exception:
                log.exception("request %s could not be dropped", rid)

    def receive(self) -> None:
        """Read and handle one message; whatever goes wrong is logged, never raised."""
        try:
            msg = decode(self.pull.recv())
        except Exception:
            log.exception("an unreadable message was dropped")
            return
        try:
            self.handle(msg)
        except _Shutdown:
            raise
        except Exception:
            log.exception("handling a %s message failed", type(msg).__name__)

    def step(self) -> None:
        start = time.monotonic() if self.trace is not None else 0.0
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("an engine step failed; its requests end with an error")
            outputs = self._fail_unfinished()
            try:
                self.engine.check_integrity()
            except Exception:
                log.critical("the KV slot ledger is broken after a failed step; exiting")
                self.push.send_pyobj(Outputs(outputs, self.engine.stats(), True))
                raise SystemExit(EXIT_CORRUPT) from None
        stats = self.engine.stats()
        counts = (stats.num_running, stats.num_waiting, stats.num_loading)
        # a look at KV transfer traffic that ran nothing reports only what changed
        if outputs or not self.engine.last_step_empty or counts != self._counts:
            self.push.send_pyobj(Outputs(outputs, stats, True))
            self._counts = counts
        shape = self.engine.last_step_shape
        if self.trace is not None and shape is not None:
            self._trace_step(start, shape, outputs, stats.tiers)

    def _trace_step(self, start: float, shape: tuple, outputs: list, tiers: Any) -> None:
        first = [o.request_id for o in outputs
                 if o.new_token_ids and o.request_id not in self._streaming]  # fmt: skip
        finished = [o.request_id for o in outputs if o.finished]
        self._streaming.update(first)
        self._streaming.difference_update(finished)
        moved = None
        if tiers is not None:  # what moved since the last traced step (this one's moves)
            if self._tiers_before is not None:
                moved = TierTrace.between(self._tiers_before, tiers)
            self._tiers_before = tiers
        self.trace.step(start, time.monotonic(), *shape, first, finished, moved)

    def _fail_unfinished(self) -> list:
        outputs = []
        for rid in list(self.engine.requests):
            try:
                out = self.engine.abort_request(rid, "error")
            except Exception:
                log.exception("request %s could not be ended", rid)
                continue
            if out is not None:
                outputs.append(dataclasses.replace(out, error=STEP_ERROR))
        return outputs

    def rpc_flush_cache(self) -> int:
        return self.engine.flush_cache()

    def rpc_clear_storage(self) -> ClearResult | None:
        return self.engine.clear_storage()

    def rpc_cache_summary(self, top: int = 10) -> TreeSummary:
        return self.engine.cache_summary(top)

    def rpc_stats(self) -> EngineStats:
        return self.engine.stats()

    def rpc_check_integrity(self) -> bool:
        self.engine.check_integrity()
        return True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        wake = self.engine.wake_fd()
        if wake is not None:
            poller.register(wake, zmq.POLLIN)
        parent = os.getppid()
        while True:
            if not self.engine.has_unfinished():
                timeout = IDLE_POLL_MS
            else:
                timeout = WAITING_POLL_MS if self.engine.last_step_empty else 0
            if timeout and os.getppid() != parent:
                return  # the HTTP process is gone: nobody will read our outputs
            ready = dict(poller.poll(timeout))
            while self.pull.poll(0):
                try:
                    self.receive()
                except _Shutdown:
                    return
            if self.engine.has_unfinished() or wake in ready:
                self.step()
            else:
                self.engine.apply_finished_transfers()
            if self.events is not None:
                self.events.sync()


def _leave_shutdown_to_the_server() -> None:
    """Ignore the SIGINT and SIGTERM meant for the whole server: a terminal's Ctrl-C and
    ``kill -TERM -PGID`` signal the process group, systemd's stop the whole cgroup. The
    server drains its running requests (which need this engine) and then sends
    ``shutdown``. A SIGTERM once the server is gone (``die_with_parent``) still ends this
    process, through the clean-up below."""
    parent = os.getppid()

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getppid() != parent:
            raise SystemExit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the idle loop's parent check still ends the process


def run_engine_process(
    config: EngineConfig, in_addr: str, out_addr: str, log_level: int = logging.INFO
) -> None:
    """Entry point of the spawned process (which inherits no logging set-up: redo it)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(message)s")
    _leave_shutdown_to_the_server()
    die_with_parent()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    publisher = None
    engine = None
    trace = None
    try:
        engine = Engine(config, transfer=Disaggregation)
        info, bridge = engine.info(), None
        if config.kv_events.kv_events_endpoint and info.kv_events_block_size:
            publisher = KVEventPublisher(
                config.kv_events.kv_events_endpoint, config.kv_events.kv_events_replay_endpoint
            )
            endpoint, replay = publisher.start()
            info = dataclasses.replace(
                info, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay
            )
            bridge = EventBridge(engine, publisher)
        if config.step_trace:
            trace = StepTraceWriter(config.step_trace)
        push.send_pyobj(Ready(info, os.getpid()))
        EngineLoop(engine, pull, push, bridge, trace).run()
    except Exception:
        # the traceback goes to the HTTP process's log, never to a client
        push.send_pyobj(Fatal(traceback.format_exc()))
        push.close(linger=1000)  # give the message time to leave
        raise
    finally:
        if publisher is not None:
            publisher.close()
        if trace is not None:
            trace.close()
        if engine is not None:
            engine.close()  # storage writes finish (a warm restart needs them); KV transfer stops
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    # A clean shutdown: nothing is left to flush, and tearing down torch's interpreter state
    # takes seconds that a server stopping under a deadline does not have.
    logging.shutdown()
    os._exit(0)
