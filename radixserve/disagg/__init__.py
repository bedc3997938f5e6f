"""Prefill/decode disaggregation: KV transfer between instances (``transfer.py`` is the
interface; ``zmq_*`` the TCP implementation that works on any machine)."""

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
