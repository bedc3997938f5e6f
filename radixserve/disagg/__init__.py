"""Prefill/decode disaggregation: KV transfer between instances (``transfer.py`` is the
interface; ``zmq_*`` the TCP implementation that works on any machine). An engine in a
disaggregation mode is built with ``Engine(config, transfer=Disaggregation)``
(``engine_side.py``: the engine's ``KVTransfer`` feature)."""

from radixserve.disagg.engine_side import Disaggregation
from radixserve.disagg.transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    TransferError,
    TransferRequest,
    TransferState,
    TransferStats,
    TransferStatus,
)

__all__ = [
    "Disaggregation",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "LayoutMismatchError",
    "TransferError",
    "TransferRequest",
    "TransferState",
    "TransferStats",
    "TransferStatus",
]
