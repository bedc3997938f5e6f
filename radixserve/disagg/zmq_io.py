"""The I/O thread behind both sides of the ZeroMQ KV transfer.

ZeroMQ sockets belong to one thread, and an engine step can take longer than a heartbeat
period, so each side keeps its sockets in a daemon thread that does nothing but move messages,
answer and send heartbeats, and notice silent peers. It never touches the KV pool. The engine
thread talks to it through two queues:

- commands in (``command``): the thread wakes at once (a pipe it polls with its sockets);
- events out (``post``): ``fileno()`` becomes readable until the engine ``drain``s them, so an
  idle engine loop can sleep on it.

A side that binds starts its context's ``guard`` (``links/guard.py``) before it binds, so
with CurveZMQ keys only allowed clients get through.

``close`` stops the thread and then frees what it used (the guard, the context and its
sockets, the two pipes). Sockets are not thread-safe, so this never happens under a thread
that is still running: if it has not stopped within ``close_timeout`` (a handler stuck), close
returns without freeing anything and the thread frees it all itself when it ends.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import zmq

from radixserve.links.guard import LinkGuard, NoGuard

log = logging.getLogger("radixserve.disagg")

DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0


class Flag:
    """A pipe used as a level-triggered flag that a poller (zmq or select) can wait on."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def set(self) -> None:
        try:
            os.write(self.write_fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full: it is readable already

    def clear(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


class IOThread(ABC):
    """Subclasses create sockets in ``setup`` (in the thread) and handle traffic in
    ``on_message``, ``on_command`` and ``on_tick``."""

    close_timeout = 10.0  # seconds close waits for the thread before leaving it to free itself

    def __init__(
        self,
        name: str,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
    ):
        if not 0 < heartbeat_interval < heartbeat_timeout:
            raise ValueError(
                f"need 0 < heartbeat_interval ({heartbeat_interval}) < heartbeat_timeout "
                f"({heartbeat_timeout})"
            )
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.ctx = zmq.Context()
        self.guard: LinkGuard | NoGuard = NoGuard()  # a binding side starts one in setup
        self.poller = zmq.Poller()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wake, self._ready = Flag(), Flag()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._setup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Who frees the resources: close, unless the thread was still running when close
        # gave up waiting (then the thread, as it ends). Both decide under this lock.
        self._owner = threading.Lock()
        self._running = False
        self._abandoned = False

    def start(self) -> None:
        self._running = True
        self._thread.start()
        self._started.wait()
        if self._setup_error is not None:
            self.close()
            raise self._setup_error

    # ---------------------------------------------------------------- engine thread side
    def command(self, *cmd: Any) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def drain(self) -> list[tuple]:
        self._ready.clear()  # before reading, so an event posted meanwhile sets it again
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def fileno(self) -> int:
        return self._ready.read_fd

    def close(self) -> None:
        if self._stop.is_set():
            return  # closed already
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(self.close_timeout)
        with self._owner:
            if self._running:
                self._abandoned = True
                log.warning(
                    "%s did not stop within %.1f s; it frees its sockets when it ends",
                    self._thread.name, self.close_timeout,
                )  # fmt: skip
                return
        self._free()

    def _free(self) -> None:
        self.guard.close()
        self.ctx.destroy(linger=0)
        self._wake.close()
        self._ready.close()

    # ---------------------------------------------------------------- I/O thread side
    def post(self, *event: Any) -> None:
        self._events.put(event)
        self._ready.set()

    @abstractmethod
    def setup(self) -> None: ...

    @abstractmethod
    def on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None: ...

    @abstractmethod
    def on_command(self, cmd: tuple) -> None: ...

    @abstractmethod
    def on_tick(self, now: float) -> None:
        """Called at least every heartbeat interval / 4: heartbeats and silence checks."""

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            with self._owner:
                self._running = False
                abandoned = self._abandoned
            if abandoned:
                self._free()

    def _serve(self) -> None:
        try:
            self.setup()
        except BaseException as e:  # e.g. the port is taken: report it to start()
            self._setup_error = e
            self._started.set()
            return
        self._started.set()
        self.poller.register(self._wake.read_fd, zmq.POLLIN)
        tick = self.heartbeat_interval / 4
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                ready = dict(self.poller.poll(max(0.0, next_tick - time.monotonic()) * 1000))
                for sock in [s for s in ready if isinstance(s, zmq.Socket)]:
                    # a handler may close the socket (a peer dropped): stop reading it then
                    while not sock.closed and sock.poll(0):
                        self.on_message(sock, sock.recv_multipart(copy=False))
                if self._wake.read_fd in ready:
                    self._wake.clear()
                while True:
                    try:
                        self.on_command(self._commands.get_nowait())
                    except queue.Empty:
                        break
                now = time.monotonic()
                if now >= next_tick:
                    self.on_tick(now)
                    next_tick = now + tick
            except zmq.ContextTerminated:
                return
            except Exception:  # a bug must not silently stop every transfer of this process
                log.exception("KV transfer I/O thread: unexpected error (continuing)")
