"""RemotePrefill: the decode instance's ``KVSource`` (see ``engine/kv_source.py``).

Decode-side reuse: the scheduler has already matched the request against this instance's
own radix tree and locked that prefix (``cached`` tokens); ``plan`` asks for the rest of the
prompt but its last token, which is computed here (it yields the first output token's
logits, as in colocated serving). ``start`` sends the prefill instance the token ids and
``skip = cached``, so it computes (with its own tree) and sends only tokens
``[skip, len - 1)``, straight into the slots allocated for them. A turn-k chat request thus
moves only the pages of what came after the decode side's cached history.

When the uncached part is shorter than ``min_tokens``, or the request's peer is ``"local"``
(the router decided so), the decode instance computes it itself (moving it would cost more
than computing it). A failed or timed-out transfer is reported to
the scheduler, which frees the slots and computes the prompt here instead. A peer that cannot
be reached is remembered (``peer_health.py``): until a background probe finds it answering
again, the requests that would go to it are computed here at once.
"""

from __future__ import annotations

import logging

from radixserve.disagg.peer_health import PeerHealth
from radixserve.disagg.transfer import KVReceiver, TransferState
from radixserve.engine.kv_source import KVSource
from radixserve.engine.request import Request
from radixserve.links.keys import split_endpoint

log = logging.getLogger("radixserve.disagg")
PREFILL_HERE = "local"  # a request's prefill peer that means: compute the prompt here


class RemotePrefill(KVSource):
    def __init__(
        self,
        receiver: KVReceiver,
        min_tokens: int,
        timeout_s: float,
        default_peer: str | None = None,
    ):
        self.receiver = receiver
        self.min_tokens = min_tokens
        self.timeout_s = timeout_s
        self.default_peer = default_peer
        self.health = PeerHealth(receiver.probe)
        self._pending: dict[str, tuple[Request, str]] = {}  # transfer id -> request, peer
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id

    @staticmethod
    def check_peer(peer: str) -> None:
        """A request's prefill peer: ``tcp://HOST:PORT`` (with ``?curve=KEY``, its server key,
        or not) or ``PREFILL_HERE``; else ValueError."""
        if peer != PREFILL_HERE and not peer.startswith("tcp://"):
            raise ValueError(f"name a prefill instance tcp://HOST:PORT, not {peer!r}")
        split_endpoint(peer)  # a key it carries must be one

    def plan(self, req: Request, cached: int) -> int:
        peer = req.spec.prefill_peer or self.default_peer
        if peer is None or peer == PREFILL_HERE:
            return 0
        n = req.num_tokens - 1 - cached
        return n if n >= self.min_tokens and self.health.usable(peer) else 0

    def start(self, req: Request) -> None:
        kv = req.kv
        meta = {"skip": kv.computed, "namespace": req.namespace}
        ids = req.token_ids[: kv.allocated].tobytes()  # int32: every token it must compute
        peer = req.spec.prefill_peer or self.default_peer
        slots = kv.slots[kv.computed : kv.allocated]
        tid = self.receiver.request(peer, slots, meta, ids, self.timeout_s)
        self._pending[tid] = (req, peer)
        self._transfer_of[req.request_id] = tid

    def poll(self) -> list[tuple[Request, str | None]]:
        ended = []
        for tid, status in self.receiver.progress():
            req, peer = self._pending.pop(tid, (None, ""))
            if req is None:
                continue
            del self._transfer_of[req.request_id]
            if status.state is TransferState.DONE:
                self.health.ok(peer)
                ended.append((req, None))
            else:
                self.health.failed(peer, status.kind, status.reason)
                log.warning(
                    "request %s: KV transfer failed (%s); computing its prompt here",
                    req.request_id,
                    status.reason,
                )
                ended.append((req, status.reason or "failed"))
        return ended

    def cancel(self, req: Request) -> None:
        tid = self._transfer_of.pop(req.request_id, None)
        if tid is not None:
            del self._pending[tid]
            self.receiver.cancel(tid, "the request ended on the decode side")

    def has_pending(self) -> bool:
        return bool(self._pending)
