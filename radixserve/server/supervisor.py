"""Supervisor: keep a set of child processes running, restarting each that dies.

Each child is a command line and an environment. A thread polls them (which also reaps a
dead one, so none stays a zombie); a child that exited is started again with the same
command after a back-off that doubles with each death in a row (``backoff_s`` up to
``max_backoff_s``) and starts over once a child has lived ``stable_s``. ``stop`` ends the
thread and terminates every child (killing those still up after ``grace_s``). The children
die with this process (``PR_SET_PDEATHSIG``). Self-contained: it knows nothing of what the
children are; ``radixserve serve --dp`` runs its instances under one.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("radixserve")


@dataclass
class Child:
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    deaths: int = 0  # deaths in a row, without living stable_s in between
    restarts: int = 0
    restart_at: float | None = None  # when a dead child is due to start again
    exits: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(
        self,
        commands: list[tuple[list[str], dict[str, str]]],
        preexec_fn: Callable[[], None] | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_s: float = 60.0,
        poll_s: float = 0.5,
    ):
        self.children = [Child(list(argv), dict(env)) for argv, env in commands]
        self.preexec_fn = preexec_fn
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start every child now (call ``watch`` once they are up)."""
        for child in self.children:
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.argv, env=child.env, preexec_fn=self.preexec_fn)
        child.started, child.restart_at = time.monotonic(), None

    def watch(self) -> None:
        """Restart dead children from now on, on a thread of its own."""
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            for i, child in enumerate(self.children):
                self._tend(i, child, now)

    def _tend(self, i: int, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at and not self._stop.is_set():
                child.restarts += 1
                log.warning("restarting instance %d (restart %d)", i, child.restarts)
                self._spawn(child)
            return
        code = child.proc.poll() if child.proc is not None else None
        if code is None:
            return
        child.exits.append(code)
        child.deaths = 1 if now - child.started >= self.stable_s else child.deaths + 1
        delay = min(self.backoff_s * 2 ** (child.deaths - 1), self.max_backoff_s)
        child.restart_at = now + delay
        log.warning("instance %d exited with code %d; restarting in %.1f s", i, code, delay)

    def alive(self) -> list[bool]:
        return [c.proc is not None and c.proc.poll() is None for c in self.children]

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop restarting, then terminate every child; kill those still up after grace_s."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        procs = [c.proc for c in self.children if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
