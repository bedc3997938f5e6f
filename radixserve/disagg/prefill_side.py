"""PrefillService: a prefill instance computing KV for decode instances.

Each transfer request (token ids, and ``skip``: how many leading tokens the decode side
holds already) becomes a *prefill-only* engine request over those tokens. It is scheduled
like any other (its own radix tree supplies what this instance has cached, chunked prefill
computes the rest); after every step, whatever of tokens ``[skip, len)`` now has KV in the
pool is pushed to the decode side, so the transfer streams while later chunks compute. Once
all is pushed the request ends (``transferred``): its KV stays in this instance's tree for
the next turn, and no token is ever sampled here.

A decode side that cancels, times out or dies ends the engine request at once (its slots go
back); a request this engine rejects or fails aborts the transfer with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from radixserve.disagg.transfer import KVSender, TransferError, TransferRequest, TransferState
from radixserve.engine.hooks import CoreHandle
from radixserve.engine.request import Request
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.spec import RequestSpec

log = logging.getLogger("radixserve.disagg")
FINISH_TRANSFERRED = "transferred"


@dataclass
class _Job:
    transfer_id: str
    req: Request
    sent: int  # tokens [0, sent) are held by the decode side or pushed


class PrefillService:
    def __init__(self, sender: KVSender):
        self.core: CoreHandle | None = None  # the engine's, given when the feature attaches
        self.sender = sender
        self._jobs: dict[str, _Job] = {}  # engine request id -> job

    def poll(self) -> None:
        """Take new transfer requests; end the engine requests of transfers that failed."""
        for t in self.sender.incoming():
            self._accept(t)
        for tid, status in self.sender.finished():
            rid = f"kv-{tid}"
            job = self._jobs.pop(rid, None)
            if job is not None and status.state is TransferState.FAILED:
                log.info("transfer %s ended by the decode side: %s", tid, status.reason)
                self.core.abort(rid, "abort")

    def _accept(self, t: TransferRequest) -> None:
        ids = np.frombuffer(t.blob, dtype=np.int32)
        skip = t.meta.get("skip")
        namespace = t.meta.get("namespace")
        if not isinstance(skip, int) or skip < 0 or skip + t.num_tokens != len(ids):
            self.sender.abort(t.transfer_id, f"bad request: skip {skip!r}, {len(ids)} token ids")
            return
        rid = f"kv-{t.transfer_id}"
        params = SamplingParams(max_tokens=1, temperature=0.0)
        spec = RequestSpec(request_id=rid, prompt_ids=ids.tolist(), params=params,
                           namespace=namespace, prefill_only=True)  # fmt: skip
        try:
            req = self.core.add(spec)
        except ValueError as e:
            self.sender.abort(t.transfer_id, f"rejected by the prefill instance: {e}")
            return
        self._jobs[rid] = _Job(t.transfer_id, req, skip)

    def after_step(self, prefilled: list[Request]) -> None:
        """Push what the step computed; end requests whose KV is all pushed."""
        for req in prefilled:
            job = self._jobs.get(req.request_id)
            if job is None:
                continue
            computed = req.kv.computed
            try:
                if computed > job.sent:
                    self.sender.push(job.transfer_id, req.kv.slots[job.sent : computed])
                    job.sent = computed
            except TransferError as e:  # it ended meanwhile (the decode side gave up)
                log.info("transfer %s: %s", job.transfer_id, e)
                del self._jobs[req.request_id]
                self.core.abort(req.request_id, "abort")
                continue
            if computed == req.num_tokens:
                self.core.abort(req.request_id, FINISH_TRANSFERRED)

    def on_failed(self, req: Request, reason: str) -> None:
        """The engine failed this request (say, its forward pass raised)."""
        job = self._jobs.pop(req.request_id, None)
        if job is not None:
            self.sender.abort(job.transfer_id, f"the prefill instance failed it: {reason}")
