"""Supervisor: keep a set of child processes running, restarting each that dies.

Each child is a command line and an environment. A thread polls them (which also reaps a
dead one, so none stays a zombie); a child that exited is started again with the same
command after the delay its ``Restarts`` gives (``restart_policy.py``, the engine client's
policy too; by default ``INSTANCE_RESTARTS``: from 1 s, doubling for each restart within a
minute, up to 30 s, never giving up). ``stop`` ends the thread and terminates every child
(killing those still up after ``grace_s``). The children die with this process when the
caller passes ``preexec_fn=die_with_parent``. Self-contained: it knows nothing of what the
children are; ``radixserve serve --dp`` runs its instances under one.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.restart_policy import RestartPolicy, Restarts

log = logging.getLogger("radixserve")
INSTANCE_RESTARTS = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0, window_s=60.0)


@dataclass
class Child:
    argv: list[str]
    env: dict[str, str]
    restarts: Restarts
    proc: subprocess.Popen | None = None
    restart_at: float | None = None  # when a dead child is due to start again
    exits: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(
        self,
        commands: list[tuple[list[str], dict[str, str]]],
        preexec_fn: Callable[[], None] | None = None,
        policy: RestartPolicy = INSTANCE_RESTARTS,
        poll_s: float = 0.5,
    ):
        self.children = [
            Child(list(argv), dict(env), Restarts(policy, f"instance {i}", log))
            for i, (argv, env) in enumerate(commands)
        ]
        self.preexec_fn = preexec_fn
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start every child now (call ``watch`` once they are up)."""
        for child in self.children:
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.argv, env=child.env, preexec_fn=self.preexec_fn)
        child.restart_at = None

    def watch(self) -> None:
        """Restart dead children from now on, on a thread of its own."""
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            for child in self.children:
                self._tend(child, now)

    def _tend(self, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at and not self._stop.is_set():
                self._spawn(child)
            return
        code = child.proc.poll() if child.proc is not None else None
        if code is None:
            return
        child.exits.append(code)
        delay = child.restarts.schedule(now, f"exited with code {code}")
        if delay is None:  # the policy gave up: the child stays down
            child.proc = None
            return
        child.restart_at = now + delay

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
