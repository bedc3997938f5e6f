"""EngineClient: the HTTP process's handle on the engine process, and its supervisor.

Starts the engine in its own (spawned) process, connected by two ZeroMQ IPC sockets in a
private temporary directory (so several servers share a machine). One background task reads
everything the engine sends and routes it: step outputs to each request's queue, replies to
waiting futures, stats to the metrics. ``add`` sends all the engine requests of one HTTP
request in one message, so the engine reads them between the same two steps and the
scheduler admits them together (the choices of ``n`` are prefilled in one step; past the
scheduler's in-flight prefix threshold, the prompt is computed once and the other choices
start together one step later, from the cache). It resolves only once the engine took them
all, so a rejected one becomes an HTTP 400 before any streaming starts, with none of its
siblings left running. A caller that gives up waiting (cancelled) aborts them all.

If the engine process dies (a crash, ``kill -9``, the OOM killer), every request in flight
fails at once with ``EngineDeadError`` (a short message; the engine's traceback, if it sent
one, goes to the log), and a new engine is started under ``ENGINE_RESTARTS``
(``restart_policy.py``: a backoff from 0.5 s, doubling). At most ``max_restarts`` restarts
within its window; past that the client gives up, ``dead`` says why, and ``on_give_up`` is
called so the server can exit non-zero for a supervisor to act. Each engine gets fresh
sockets: nothing sent to a dead one reaches the next. Sends never block: with no engine to
take a message, the request fails at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from radixserve.config import EngineConfig
from radixserve.engine import StepOutput
from radixserve.engine.spec import RequestSpec
from radixserve.engine.stats import EngineInfo, EngineStats
from radixserve.restart_policy import RestartPolicy, Restarts
from radixserve.server.engine_process import run_engine_process
from radixserve.server.messages import (
    Abort,
    Added,
    AddRequest,
    Fatal,
    FromEngine,
    Outputs,
    Ready,
    Rejected,
    Rpc,
    RpcReply,
    Shutdown,
    ToEngine,
    encode,
)

log = logging.getLogger("radixserve.server")

ENGINE_RESTARTS = RestartPolicy(backoff_s=0.5, max_backoff_s=30.0, window_s=600.0,
                                limit_name="--engine-restarts")  # fmt: skip
POLL_MS = 200
START_TIMEOUT_S = 600.0
DIED = "the engine process failed while this request ran; it is being restarted"


class EngineDeadError(RuntimeError):
    """The engine cannot serve this request now (it died, or is being restarted)."""


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        on_stats: Callable[[EngineStats, bool], None],
        log_level: int = logging.INFO,
        max_restarts: int = 3,
        on_give_up: Callable[[], None] | None = None,
    ):
        self.config, self.on_stats, self.log_level = config, on_stats, log_level
        self.max_restarts, self.on_give_up = max_restarts, on_give_up
        self._dir = tempfile.mkdtemp(prefix="radixserve-")
        self._ctx = zmq.asyncio.Context()
        self._generation = 0
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._process: mp.process.BaseProcess | None = None
        self._queues: dict[str, tuple[asyncio.Queue, Any]] = {}
        self._pending: dict[Any, asyncio.Future] = {}
        self._calls = itertools.count()
        self._supervisor: asyncio.Task | None = None
        self._restarts = Restarts(
            dataclasses.replace(ENGINE_RESTARTS, max_restarts=max_restarts), "the engine", log
        )
        self.info: EngineInfo | None = None
        self.pid: int | None = None  # the engine process's, as it reported when ready
        self.state = "starting"  # starting, ready, restarting, dead
        self.dead: str | None = None  # why the client gave up

    # ------------------------------------------------------------------ life cycle
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def num_inflight(self) -> int:
        return len(self._queues)

    def _spawn(self) -> None:
        """A new engine process on new sockets (the old ones are closed unread)."""
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._generation += 1
        in_addr = f"ipc://{self._dir}/in-{self._generation}"
        out_addr = f"ipc://{self._dir}/out-{self._generation}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a burst of requests
        self._pull = self._ctx.socket(zmq.PULL)
        self._push.bind(in_addr)
        self._pull.bind(out_addr)
        self._process = mp.get_context("spawn").Process(
            target=run_engine_process,
            args=(self.config, in_addr, out_addr, self.log_level),
            daemon=True,
            name="radixserve-engine",
        )
        self._process.start()

    async def _wait_ready(self, timeout: float) -> EngineInfo:
        deadline = time.monotonic() + timeout
        while True:
            if await self._pull.poll(POLL_MS):
                msg = await self._pull.recv_pyobj()
                if isinstance(msg, Ready):
                    self.pid = msg.pid
                    return msg.info
                if isinstance(msg, Fatal):
                    log.error("the engine failed to start:\n%s", msg.traceback)
                    raise EngineDeadError(
                        f"the engine failed to start: {_last_line(msg.traceback)}"
                    )
            if not self._process.is_alive():
                raise EngineDeadError(f"the engine process exited ({self._process.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDeadError("the engine did not start in time")

    async def start(self, timeout: float = START_TIMEOUT_S) -> EngineInfo:
        self._spawn()
        self.info = await self._wait_ready(timeout)
        disagg = self.info.disaggregation
        if disagg is not None and disagg.endpoint:  # a restarted engine keeps its KV port,
            port = int(disagg.endpoint.rsplit(":", 1)[1])  # where decode instances look
            self.config = self.config.replace(kv_transfer_port=port)
        self.state = "ready"
        self._supervisor = asyncio.create_task(self._supervise())
        return self.info

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        process = self._process
        if process is not None and process.is_alive():
            self._send(Shutdown())
            await asyncio.to_thread(process.join, 10)
        if process is not None and process.is_alive():
            process.kill()  # it ignores SIGTERM while this process lives (engine_process.py)
            process.join(10)
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _supervise(self) -> None:
        while True:
            reason = await self._read_until_death()
            log.error("the engine died: %s", reason)
            self._fail_inflight(DIED)
            if not await self._restart():
                return

    @property
    def num_restarts(self) -> int:
        return self._restarts.count

    async def _restart(self) -> bool:
        cause = "died"
        while True:
            delay = self._restarts.schedule(time.monotonic(), cause)
            if delay is None:
                self.state, self.dead = "dead", self._restarts.gave_up
                if self.on_give_up is not None:
                    self.on_give_up()
                return False
            self.state = "restarting"
            await asyncio.sleep(delay)
            if self._process is not None and self._process.is_alive():
                self._process.kill()
            if self._process is not None:
                await asyncio.to_thread(self._process.join, 10)
            self._spawn()
            try:
                self.info = await self._wait_ready(START_TIMEOUT_S)
            except EngineDeadError as e:
                log.error("the restarted engine did not come up: %s", e)
                cause = "did not come back"
                continue
            self.state = "ready"
            log.warning("the engine is back (pid %s)", self.pid)
            return True

    async def _read_until_death(self) -> str:
        """Route everything the engine sends until it dies; return how it died."""
        while True:
            if not await self._pull.poll(POLL_MS):
                if not self._process.is_alive():
                    return f"the engine process exited with code {self._process.exitcode}"
                continue
            msg = await self._pull.recv_pyobj()
            if isinstance(msg, Fatal):
                log.error("the engine crashed:\n%s", msg.traceback)
                await asyncio.to_thread(self._process.join, 5)
                return f"the engine crashed: {_last_line(msg.traceback)}"
            self._route(msg)

    def _route(self, msg: FromEngine) -> None:
        if isinstance(msg, Outputs):
            for out in msg.outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    entry[0].put_nowait((entry[1], out))
                    if out.finished:
                        del self._queues[out.request_id]
            self.on_stats(msg.stats, msg.after_step)
        elif isinstance(msg, Added | Rejected):
            fut = self._pending.pop(("add", tuple(msg.request_ids)), None)
            if fut is not None and not fut.done():
                fut.set_result(msg if isinstance(msg, Rejected) else None)
        elif isinstance(msg, RpcReply):
            self.on_stats(msg.stats, False)
            fut = self._pending.pop(("rpc", msg.call_id), None)
            if fut is not None and not fut.done():
                fut.set_result((msg.ok, msg.value))

    def _fail_inflight(self, reason: str) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        for queue, tag in self._queues.values():
            queue.put_nowait((tag, EngineDeadError(reason)))
        self._pending.clear()
        self._queues.clear()

    # ------------------------------------------------------------------ requests
    def _check_ready(self) -> None:
        if self.state == "dead":
            raise EngineDeadError(self.dead or "the engine is gone")
        if self.state != "ready":
            raise EngineDeadError("the engine is restarting; retry shortly")

    def _send(self, msg: ToEngine | bytes) -> bool:
        """Send without waiting; False where no engine is connected to take it."""
        try:
            data = msg if isinstance(msg, bytes) else encode(msg)
            fut = self._push.send(data, flags=zmq.DONTWAIT)
        except zmq.Again:
            return False
        if fut.done():
            return fut.exception() is None
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return True

    async def add(self, specs: list[RequestSpec], queue: asyncio.Queue) -> None:
        """Queue the engine requests of one HTTP request, together; their outputs arrive in
        ``queue`` as ``(index in specs, StepOutput)``. Raises ``ValueError`` with the engine's
        message if it refuses any of them (then none runs), and ``EngineDeadError`` if there
        is no engine to take them."""
        self._check_ready()
        ids = [spec.request_id for spec in specs]
        # the engine's step trace records when the requests left here
        sent_at = time.monotonic() if self.config.step_trace else None
        try:
            data = encode(AddRequest(specs, sent_at))
        except OverflowError as e:  # an integer past 64 bits: only token ids can be one
            vocab = self.info.vocab_size if self.info is not None else None
            raise ValueError(f"prompt token ids must be in [0, {vocab})") from e
        key = ("add", tuple(ids))
        fut = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        for i, rid in enumerate(ids):
            self._queues[rid] = (queue, i)
        if not self._send(data):
            self._forget(key, ids)
            raise EngineDeadError("the engine is not taking requests; retry shortly")
        try:
            rejected = await fut
        except asyncio.CancelledError:  # nobody waits for them any more
            self._forget(key, ids)
            for rid in ids if self.ready else ():
                self._send(Abort(rid, "abort"))  # after the add, on the same socket
            raise
        if rejected is not None:
            self._forget(key, ids)
            log.debug("request %s refused: %s", ids[rejected.index], rejected.message)
            raise ValueError(rejected.message)

    def _forget(self, key: tuple, request_ids: list[str]) -> None:
        self._pending.pop(key, None)
        for rid in request_ids:
            self._queues.pop(rid, None)

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        if self.ready:
            self._send(Abort(request_id, reason))

    async def call(self, name: str, **kwargs: Any) -> Any:
        self._check_ready()
        call_id = next(self._calls)
        fut = asyncio.get_running_loop().create_future()
        self._pending[("rpc", call_id)] = fut
        if not self._send(Rpc(call_id, name, kwargs)):
            self._pending.pop(("rpc", call_id), None)
            raise EngineDeadError("the engine is not taking requests; retry shortly")
        ok, value = await fut
        if not ok:
            raise RuntimeError(value)
        return value


def _last_line(traceback_text: str) -> str:
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "unknown error"


__all__ = ["EngineClient", "EngineDeadError", "StepOutput"]
