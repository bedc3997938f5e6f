"""Bulk payloads sealed with AES-256-GCM under a session key agreed over CurveZMQ.

CurveZMQ authenticates a link's two ends and encrypts every message with XSalsa20-Poly1305,
in libzmq's I/O thread, one message at a time: for hundreds of megabytes of KV that cipher,
not the network, sets the rate. A link that moves bulk data keeps CurveZMQ for the
handshake and its control messages and sends the bulk over a second, plain ZeroMQ
connection, every message sealed here with AES-256-GCM (AES-NI and carry-less multiply,
several GB/s a core, from the ``cryptography`` package):

- **Key schedule.** Each end draws a fresh 32-byte random share per connection (``new_share``)
  and sends it over the CurveZMQ channel, which authenticates the peer and keeps the share
  secret; both derive ``SessionKeys`` = HKDF-SHA256(client share || server share), one
  256-bit key per direction (``info`` names the direction), so the two directions never
  share a key and a new connection never reuses an old key.
- **Nonces.** A message has a sequence number, 1, 2, 3, ... per direction (8 bytes); its i-th
  payload is sealed with the 96-bit nonce (sequence, i). A ``Sealer`` never repeats one, and a
  session's key is dropped long before 2^64 messages.
- **What is authenticated.** Each payload's tag covers the payload and, as associated data,
  the message's kind, its header (in the clear: transfer id, token and layer ranges) and its
  number of payloads; the nonce binds the sequence number and the payload's place. So a
  changed byte, a header moved to another payload, a payload moved to another message and a
  payload dropped all fail the check.
- **Replays and reordering.** An ``Opener`` takes only sequence numbers above the last one it
  accepted: a replayed message or one overtaken by a later one is refused (``SealError``),
  and a refused message does not move it, so a forged one in the stream costs nothing.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SHARE_BYTES = 32
TAG_BYTES = 16
SEQ = struct.Struct("!Q")
_NONCE = struct.Struct("!QI")
_AAD = struct.Struct("!I")
_INFO = b"radixserve sealed link v1: "


class SealError(ValueError):
    """A sealed message that is malformed, forged, tampered with, replayed or reordered."""


def new_share() -> bytes:
    return os.urandom(SHARE_BYTES)


@dataclass(frozen=True)
class SessionKeys:
    """The two directions' keys of one connection, as one end sees them."""

    send: bytes = field(repr=False)
    receive: bytes = field(repr=False)

    @classmethod
    def derive(cls, client_share: bytes, server_share: bytes, *, client: bool) -> SessionKeys:
        if len(client_share) != SHARE_BYTES or len(server_share) != SHARE_BYTES:
            raise SealError(f"a key share must be {SHARE_BYTES} bytes")
        secret = client_share + server_share
        to_server, to_client = (_hkdf(secret, _INFO + d) for d in (b"to server", b"to client"))
        return cls(to_server, to_client) if client else cls(to_client, to_server)


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _aad(kind: bytes, header: bytes, count: int) -> bytes:
    return kind + _AAD.pack(count) + header


class Sealer:
    """Seals one direction's messages; one owner (thread) per sealer."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._seq = 0

    def seal(self, kind: bytes, header: bytes, payloads: Sequence[Any]) -> list[bytes]:
        """``[sequence, sealed payload, ...]``: the frames after ``kind`` and ``header``."""
        if not payloads:
            raise ValueError("a sealed message carries at least one payload (b'' will do)")
        self._seq += 1
        aad = _aad(kind, header, len(payloads))
        return [SEQ.pack(self._seq)] + [
            self._aead.encrypt(_NONCE.pack(self._seq, i), p, aad) for i, p in enumerate(payloads)
        ]


class Opener:
    """Opens the other direction's messages, in sending order only."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self.last = 0  # the highest sequence number accepted

    def open(self, kind: bytes, header: bytes, seq: Any, sealed: Sequence[Any]) -> list[bytearray]:
        """The payloads, or ``SealError``; only a message that passes moves the sequence."""
        if len(seq) != SEQ.size or not sealed:
            raise SealError("not a sealed message (no sequence number or no payload)")
        (n,) = SEQ.unpack(seq)
        if n <= self.last:
            raise SealError(f"message {n} replayed or out of order (after {self.last})")
        aad = _aad(kind, header, len(sealed))
        out = []
        for i, c in enumerate(sealed):
            if len(c) < TAG_BYTES:
                raise SealError("a sealed payload shorter than its tag")
            buf = bytearray(len(c) - TAG_BYTES)
            try:
                self._aead.decrypt_into(_NONCE.pack(n, i), c, aad, buf)
            except InvalidTag:
                raise SealError(
                    f"message {n}: payload {i} altered or sealed under another key"
                ) from None
            out.append(buf)
        self.last = n
        return out
