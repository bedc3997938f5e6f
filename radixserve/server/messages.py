"""The messages between the HTTP process and the engine process, one type each.

To the engine (PUSH -> PULL) as msgpack, decoded against the ``ToEngine`` union (a message
that does not match the schema is refused whole, never half-read):

    AddRequest(specs, sent_at) -> Added(request_ids) or Rejected(request_ids, index, message)
    Abort(request_id, reason)  -> the request's final output (in an ``Outputs``)
    Rpc(call_id, name, kwargs) -> RpcReply(call_id, ok, value, stats)
    Shutdown()                 -> the process exits

From the engine (PUSH -> PULL) as pickled dataclasses (they carry the engine's typed
boundary objects, ``EngineInfo``, ``EngineStats``, ``StepOutput``): the replies above,
``Outputs(outputs, stats, after_step)`` after every step (``after_step``) or abort,
``Ready(info, pid)`` once the model is loaded and ``Fatal(traceback)`` before dying on a bug.

One ``AddRequest`` carries all the engine requests of one HTTP request (its prompts x ``n``),
so the engine reads them between the same two steps and they share their first step. The
engine takes all of them or none: ``Rejected`` names the one it refused (``index``) and the
others were never admitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixserve.engine.core import StepOutput
from radixserve.engine.spec import RequestSpec
from radixserve.engine.stats import EngineInfo, EngineStats


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    specs: list[RequestSpec]  # one HTTP request's engine requests, taken together or not at all
    sent_at: float | None = None  # the HTTP side's monotonic clock, with --step-trace


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str
    reason: str = "abort"


class Rpc(msgspec.Struct, frozen=True, tag="rpc"):
    call_id: int
    name: str
    kwargs: dict[str, Any] = {}


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


ToEngine = AddRequest | Abort | Rpc | Shutdown
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ToEngine)


def encode(msg: ToEngine) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> ToEngine:
    """``msgspec.ValidationError`` (a ``ValueError``) when ``data`` is not a message."""
    return _decoder.decode(data)


@dataclass(frozen=True)
class Added:
    request_ids: list[str]  # those of the AddRequest, in its order


@dataclass(frozen=True)
class Rejected:
    request_ids: list[str]  # those of the AddRequest: none of them was admitted
    index: int  # the one refused
    message: str


@dataclass(frozen=True)
class Outputs:
    outputs: list[StepOutput]
    stats: EngineStats
    after_step: bool  # False: the answer to an abort


@dataclass(frozen=True)
class RpcReply:
    call_id: int
    ok: bool
    value: Any
    stats: EngineStats


@dataclass(frozen=True)
class Ready:
    info: EngineInfo
    pid: int


@dataclass(frozen=True)
class Fatal:
    traceback: str


FromEngine = Added | Rejected | Outputs | RpcReply | Ready | Fatal
