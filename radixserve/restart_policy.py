"""When a process that died is started again, and when to stop trying: one policy for the
server's engine process (``server/engine_client.py``) and for the instances of a fleet
(``fleet/supervisor.py``).

A ``RestartPolicy`` is the schedule (frozen, validated); a ``Restarts`` is one process's
history under it. After a death, ``Restarts.schedule(now)`` counts the restarts of the last
``window_s`` seconds: with ``max_restarts`` of them already, it gives up (``None``, logged as
critical, the reason in ``gave_up``); otherwise it books one more restart and returns the
delay before it: ``backoff_s`` doubled for each recent restart, at most ``max_backoff_s``. A
process that lived a whole window since its last restart starts over at ``backoff_s``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5  # delay before the first restart of a window
    max_backoff_s: float = 30.0
    window_s: float = 600.0  # restarts older than this are forgotten
    max_restarts: int | None = None  # within window_s; None: never give up
    limit_name: str = ""  # the option that sets max_restarts, named when giving up

    def __post_init__(self) -> None:
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"backoff_s must be in [0, max_backoff_s], got {self.backoff_s!r} and "
                f"{self.max_backoff_s!r}"
            )
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts!r}")

    def delay(self, recent: int) -> float:
        """The wait before a restart that follows ``recent`` restarts in the window."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** min(recent, 64))


class Restarts:
    """The restarts of one process (``what``, as the log names it) under ``policy``."""

    def __init__(self, policy: RestartPolicy, what: str, log: logging.Logger):
        self.policy, self.what, self.log = policy, what, log
        self.count = 0  # restarts booked, ever
        self.gave_up: str | None = None  # why, once schedule() has refused
        self._times: deque[float] = deque()  # when each booked restart is due

    def recent(self, now: float) -> int:
        """Restarts booked within the policy's window before ``now``."""
        while self._times and self._times[0] < now - self.policy.window_s:
            self._times.popleft()
        return len(self._times)

    def schedule(self, now: float, cause: str = "died") -> float | None:
        """After a death (``cause``, for the log) at ``now``: the delay before the restart,
        booked; or ``None`` where the policy's limit is used up (then ``gave_up`` says why)."""
        p = self.policy
        recent = self.recent(now)
        if p.max_restarts is not None and recent >= p.max_restarts:
            limit = f" ({p.limit_name})" if p.limit_name else ""
            self.gave_up = (
                f"{self.what} {cause} and {recent} restart(s) within {p.window_s:.0f} s "
                f"used up the limit{limit}; giving up"
            )
            self.log.critical(self.gave_up)
            return None
        delay = p.delay(recent)
        self._times.append(now + delay)
        self.count += 1
        of = f" of at most {p.max_restarts}" if p.max_restarts is not None else ""
        self.log.warning(
            "%s %s; restarting %s in %.1f s (restart %d%s within %.0f s)",
            self.what, cause, self.what, delay, recent + 1, of, p.window_s,
        )  # fmt: skip
        return delay
