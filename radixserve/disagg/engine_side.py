"""What an engine in a disaggregation mode carries: the transfer endpoint of its role, as a
``Feature`` (``engine/hooks.py``) the engine core calls at its hook points.

- ``prefill``: a ``KVSender`` bound on ``kv_transfer_host:kv_transfer_port`` and a
  ``PrefillService`` that turns transfer requests into prefill-only engine requests.
- ``decode``: a ``KVReceiver`` and ``RemotePrefill``, the scheduler's ``KVSource``.

The model identity in the handshake is the model's name plus a fingerprint of its
architecture and of some of its weights, so two instances only pair when they run the same
model in the same dtype.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from radixserve.disagg.decode_side import RemotePrefill
from radixserve.disagg.prefill_side import PrefillService
from radixserve.disagg.transfer import KVLayout, TransferStats
from radixserve.disagg.zmq_receiver import ZmqKVReceiver
from radixserve.disagg.zmq_sender import ZmqKVSender
from radixserve.engine.hooks import CoreHandle, KVTransfer
from radixserve.engine.kv_source import KVSource
from radixserve.engine.request import Request
from radixserve.engine.scheduler import Step
from radixserve.engine.spec import RequestSpec
from radixserve.model.quant import QuantizedWeight

HEARTBEAT_TIMEOUT_PERIODS = 5  # a peer is dead after this many missed heartbeats


def _weight_sample(w) -> list[torch.Tensor]:
    """A few rows of a weight, plain or quantized (its format and scales included: two
    quantizations of one model write different KV and must not pair)."""
    if isinstance(w, QuantizedWeight):
        return [torch.tensor(list(w.fmt.encode()))] + [t[:8] for t in w.tensors()]
    return [w[:8]]


def model_identity(engine) -> str:
    model = engine.model
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(model.config).encode())
    for w in (model.embed, model.norm, model.layers[0]["qkv"]):
        for t in _weight_sample(w):
            h.update(t.detach().float().cpu().numpy().tobytes())
    return f"{engine.model_name}:{h.hexdigest()}"


@dataclass(frozen=True)
class DisaggInfo:
    mode: str
    layout: KVLayout
    endpoint: str | None  # prefill: where decode instances connect


class Disaggregation(KVTransfer):
    def __init__(self, engine):
        config = engine.config
        self.mode = config.disagg.disaggregation_mode
        self.layout = KVLayout.of_pool(engine.pool, model_identity(engine), config.cache.page_size)
        beat = dict(
            heartbeat_interval=config.disagg.kv_transfer_heartbeat,
            heartbeat_timeout=config.disagg.kv_transfer_heartbeat * HEARTBEAT_TIMEOUT_PERIODS,
        )
        self.kv_source: KVSource | None = None
        self.service: PrefillService | None = None
        self.sender: ZmqKVSender | None = None
        security = config.links.security()
        if self.mode == "prefill":
            self.sender = ZmqKVSender(
                engine.pool,
                self.layout,
                config.disagg.kv_transfer_host,
                config.disagg.kv_transfer_port,
                security=security,
                data_port=config.disagg.kv_transfer_data_port,
                **beat,
            )
            self.endpoint: str | None = self.sender.endpoint
            self.service = PrefillService(self.sender)
            self.link = self.sender
        else:
            self.receiver = ZmqKVReceiver(engine.pool, self.layout, security=security, **beat)
            self.endpoint = None
            self.kv_source = RemotePrefill(
                self.receiver,
                config.disagg.remote_prefill_min_tokens,
                config.disagg.kv_transfer_timeout,
                config.disagg.prefill_endpoint,
            )
            self.link = self.receiver

    # ------------------------------------------------------------------ hooks
    def attach(self, core: CoreHandle) -> None:
        if self.service is not None:
            self.service.core = core

    def check(self, spec: RequestSpec) -> None:
        if spec.prefill_peer is not None:  # a decode instance (the core checked that)
            RemotePrefill.check_peer(spec.prefill_peer)
        if spec.segments:
            raise ValueError("RAG segments are not supported with disaggregation")

    def before_schedule(self) -> None:
        if self.service is not None:  # take transfer requests, drop cancelled ones
            self.service.poll()

    def after_forward(self, step: Step) -> None:
        if self.service is not None:  # push the new KV, end fully pushed requests
            self.service.after_step([r for r, _ in step.prefills if r.spec.prefill_only])

    def on_finish(self, req: Request, reason: str, error: str | None) -> None:
        if self.service is not None and error is not None and req.spec.prefill_only:
            self.service.on_failed(req, error)

    def has_pending(self) -> bool:
        return self.kv_source is not None and self.kv_source.has_pending()

    def fileno(self) -> int:
        return self.link.fileno()

    def info(self) -> DisaggInfo:
        return DisaggInfo(self.mode, self.layout, self.endpoint)

    def stats(self) -> TransferStats:
        stats = self.link.stats.copy()
        stats.refused = self.link.refused()
        return stats

    def close(self) -> None:
        self.link.close()
