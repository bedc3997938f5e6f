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
the scheduler, which frees the slots and computes the prompt here instead.
"""

from __future__ import annotations

import logging

from radixserve.disagg.transfer import KVReceiver, TransferState
from radixserve.engine.kv_source import KVSource
from radixserve.engine.request import Request

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
        self._pending: dict[str, Request] = {}  # transfer id -> request
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id

    @staticmethod
    def check_peer(peer: str) -> None:
        """A request's prefill peer: ``tcp://HOST:PORT`` or ``PREFILL_HERE``; else ValueError."""
        if peer != PREFILL_HERE and not peer.startswith("tcp://"):
            raise ValueError(f"name a prefill instance tcp://HOST:PORT, not {peer!r}")

    def plan(self, req: Request, cached: int) -> int:
        peer = req.spec.prefill_peer
        if peer == PREFILL_HERE or (peer or self.default_peer) is None:
            return 0
        n = req.num_tokens - 1 - cached
        return n if n >= self.min_tokens else 0

    def start(self, req: Request) -> None:
        kv = req.kv
        meta = {"skip": kv.computed, "namespace": req.namespace}
        ids = req.token_ids[: kv.allocated].tobytes()  # int32: every token it must compute
        tid = self.receiver.request(
            req.spec.prefill_peer or self.default_peer,
            kv.slots[kv.computed : kv.allocated],
            meta,
            ids,
            self.timeout_s,
        )
        self._pending[tid] = req
        self._transfer_of[req.request_id] = tid

    def poll(self) -> list[tuple[Request, str | None]]:
        ended = []
        for tid, status in self.receiver.progress():
            req = self._pending.pop(tid, None)
            if req is None:
                continue
            del self._transfer_of[req.request_id]
            if status.state is TransferState.DONE:
                ended.append((req, None))
            else:
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
