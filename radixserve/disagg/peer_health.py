"""PeerHealth: the decode side's memory of prefill peers that failed (a circuit breaker).

A transfer that fails because its peer could not be reached (no answer to the handshake, a
refused handshake, KV layouts that differ, a peer gone silent) opens that peer's breaker:
requests that would go to it compute their prompts here at once, instead of each waiting
for the handshake timeout. Once the back-off has passed (``first_backoff`` seconds, doubling
up to ``max_backoff`` while the peer keeps failing), the next request naming the peer starts
a probe, a handshake in the background, and is itself computed here; the probe's success
closes the breaker, its failure doubles the back-off. A transfer that completes closes it
too. Failures of one transfer on a live peer (it aborted, a deadline, bad data) say nothing
about the peer and leave the breaker alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

log = logging.getLogger("radixserve.disagg")

# TransferStatus.kind values that mean the peer itself is unreachable or unusable
PEER_FAILURES = frozenset({"connect", "handshake", "layout", "peer_lost"})


@dataclass
class _Down:
    until: float  # no probe before this
    backoff: float  # seconds, the current step
    probe: Future | None = None  # a handshake under way


class PeerHealth:
    def __init__(
        self,
        probe: Callable[[str], Future],
        first_backoff: float = 1.0,
        max_backoff: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._probe, self._clock = probe, clock
        self.first_backoff, self.max_backoff = first_backoff, max_backoff
        self._down: dict[str, _Down] = {}

    def usable(self, peer: str) -> bool:
        """Whether a request may ask ``peer`` now; may start (or read) a probe."""
        down = self._down.get(peer)
        if down is None:
            return True
        now = self._clock()
        if down.probe is not None and down.probe.done():
            error = down.probe.exception()
            down.probe = None
            if error is None:
                del self._down[peer]
                log.info("prefill peer %s answers again; sending it requests", peer)
                return True
            down.backoff = min(down.backoff * 2, self.max_backoff)
            down.until = now + down.backoff
        if down.probe is None and now >= down.until:
            down.probe = self._probe(peer)
        return False

    def failed(self, peer: str, kind: str, reason: str | None) -> None:
        """A transfer from ``peer`` failed with ``kind`` (``TransferStatus.kind``)."""
        if kind not in PEER_FAILURES or peer in self._down:
            return
        self._down[peer] = _Down(self._clock() + self.first_backoff, self.first_backoff)
        log.warning(
            "prefill peer %s failed (%s); computing prompts here until it answers a probe",
            peer,
            reason or kind,
        )

    def ok(self, peer: str) -> None:
        """A transfer from ``peer`` completed."""
        self._down.pop(peer, None)

    def down(self) -> list[str]:
        return sorted(self._down)
