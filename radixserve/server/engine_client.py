"""EngineClient: the HTTP process's handle on the engine process.

Starts the engine in its own (spawned) process, connected by two ZeroMQ IPC sockets in a
private temporary directory (so several servers share a machine). One background task reads
everything the engine sends and routes it: step outputs to each request's queue, replies to
waiting futures, stats to the metrics. ``add`` resolves only once the engine accepted the
request, so a rejected one becomes an HTTP 400 before any streaming starts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from radixserve.config import EngineConfig
from radixserve.engine import SamplingParams, StepOutput
from radixserve.engine.stats import EngineInfo, EngineStats
from radixserve.server.engine_process import run_engine_process


class EngineDeadError(RuntimeError):
    pass


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        on_stats: Callable[[EngineStats, bool], None],
        log_level: int = logging.INFO,
    ):
        self.config = config
        self.on_stats = on_stats
        self._dir = tempfile.mkdtemp(prefix="radixserve-")
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._push.bind(in_addr)
        self._pull.bind(out_addr)
        self._process = mp.get_context("spawn").Process(
            target=run_engine_process,
            args=(config, in_addr, out_addr, log_level),
            daemon=True,
            name="radixserve-engine",
        )
        self._queues: dict[str, tuple[asyncio.Queue, Any]] = {}
        self._pending: dict[Any, asyncio.Future] = {}
        self._calls = itertools.count()
        self._reader: asyncio.Task | None = None
        self.info: EngineInfo | None = None
        self.pid: int | None = None
        self.dead: str | None = None

    # ------------------------------------------------------------------ life cycle
    async def start(self, timeout: float = 600.0) -> EngineInfo:
        self._process.start()
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if await self._pull.poll(500):
                msg = await self._pull.recv_pyobj()
                if msg[0] == "ready":
                    _, self.info, self.pid = msg
                    break
                if msg[0] == "fatal":
                    raise EngineDeadError(f"the engine failed to start:\n{msg[1]}")
            if not self._process.is_alive():
                raise EngineDeadError(f"the engine process exited ({self._process.exitcode})")
            if asyncio.get_running_loop().time() > deadline:
                raise EngineDeadError("the engine did not start in time")
        self._reader = asyncio.create_task(self._read_loop())
        return self.info

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._process.is_alive():
            await self._push.send_pyobj(("shutdown",))
            await asyncio.to_thread(self._process.join, 10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _read_loop(self) -> None:
        while True:
            if not await self._pull.poll(1000):
                if not self._process.is_alive():
                    self._fail(f"the engine process exited ({self._process.exitcode})")
                    return
                continue
            msg = await self._pull.recv_pyobj()
            kind = msg[0]
            if kind == "outputs":
                for out in msg[1]:
                    entry = self._queues.get(out.request_id)
                    if entry is not None:
                        entry[0].put_nowait((entry[1], out))
                        if out.finished:
                            del self._queues[out.request_id]
                self.on_stats(msg[2], msg[3])
            elif kind in ("added", "rejected"):
                fut = self._pending.pop(("add", msg[1]), None)
                if fut is not None and not fut.done():
                    fut.set_result(None if kind == "added" else msg[2])
            elif kind == "rpc":
                self.on_stats(msg[4], False)
                fut = self._pending.pop(("rpc", msg[1]), None)
                if fut is not None and not fut.done():
                    fut.set_result((msg[2], msg[3]))
            elif kind == "fatal":
                self._fail(f"the engine crashed:\n{msg[1]}")
                return

    def _fail(self, reason: str) -> None:
        self.dead = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        for queue, tag in self._queues.values():
            queue.put_nowait((tag, EngineDeadError(reason)))
        self._pending.clear()
        self._queues.clear()

    # ------------------------------------------------------------------ requests
    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    async def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        tag: Any = None,
        prefill_peer: str | None = None,
    ) -> None:
        """Queue a request; its outputs arrive in ``queue`` as ``(tag, StepOutput)``.
        Raises ``ValueError`` with the engine's message if the engine rejects it.
        ``prefill_peer``: on a decode instance, the prefill instance to take its KV from."""
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._pending[("add", request_id)] = fut
        self._queues[request_id] = (queue, tag)
        options = {"prefill_peer": prefill_peer} if prefill_peer else {}
        await self._push.send_pyobj(("add", request_id, prompt_ids, params, options))
        error = await fut
        if error is not None:
            self._queues.pop(request_id, None)
            raise ValueError(error)

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        if not self.dead:
            await self._push.send_pyobj(("abort", request_id, reason))

    async def call(self, name: str, **kwargs: Any) -> Any:
        self._check_alive()
        call_id = next(self._calls)
        fut = asyncio.get_running_loop().create_future()
        self._pending[("rpc", call_id)] = fut
        await self._push.send_pyobj(("rpc", call_id, name, kwargs))
        ok, value = await fut
        if not ok:
            raise RuntimeError(value)
        return value


__all__ = ["EngineClient", "EngineDeadError", "StepOutput"]
