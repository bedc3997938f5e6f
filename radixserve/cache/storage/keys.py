"""Storage keys: chained page hashes scoped by model and KV layout.

A page's key is ``blake2b-128(previous key, namespace, page tokens)``, chained from a scope
root ``blake2b-128(model id, layout descriptor)``. So a key names a whole prefix (equal keys
mean equal tokens from the start, same model, same layout, same namespace), and any two
instances of one model compute the same keys with no coordination.

The recipe mirrors ``cache.events.chain_page_hashes`` (parent, ``repr(namespace)`` salt, int32
page tokens) but is 128-bit and scoped: an event hash that collides only misroutes a request,
while a storage key that collides in a store shared by many instances would serve another
prefix's KV, silently. The tree keeps the last key of each node and chains from it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.cache.storage.page_format import KEY_BYTES, PageLayout


def _slug(text: str) -> str:
    """A short, glob-free tag for names people read (directory names, Redis key prefixes)."""
    tail = re.split(r"[\\/]", text.rstrip("/\\"))[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", tail)[:40].strip("-.") or "model"


@dataclass(frozen=True)
class StorageScope:
    """Which KV pages are interchangeable: one model (by identity) in one page layout.

    ``model_id`` must be equal across instances serving the same weights and differ for any
    other weights (e.g. the model file's name and a digest of its contents).
    """

    model_id: str
    layout: PageLayout
    root: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("StorageScope.model_id must be a non-empty string")
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(b"radixserve-kv\0" + self.model_id.encode() + b"\0")
        h.update(self.layout.descriptor.encode())
        object.__setattr__(self, "root", h.digest())

    @property
    def tag(self) -> str:
        """Readable and unique: the model's name, then 16 hex digits of the scope root."""
        return f"{_slug(self.model_id)}-{self.root.hex()[:16]}"


def chain_page_keys(
    scope: StorageScope,
    parent_key: bytes | None,
    tokens: Sequence[int] | np.ndarray,
    namespace: Any = None,
) -> list[bytes]:
    """Keys of the whole pages of ``tokens``, each chained to the one before.

    ``parent_key`` is the key of the page just before ``tokens`` (None at the start of a
    sequence). A trailing partial page gets no key.
    """
    page = scope.layout.page_size
    ids = np.asarray(tokens, dtype="<i4").reshape(-1)
    salt = repr(namespace).encode() if namespace is not None else b""
    salt_len = len(salt).to_bytes(4, "little")
    prev = scope.root if parent_key is None else parent_key
    if len(prev) != KEY_BYTES:
        raise ValueError(f"parent_key must be {KEY_BYTES} bytes, got {len(prev)}")
    keys = []
    for start in range(0, len(ids) - page + 1, page):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(salt_len + salt)
        h.update(ids[start : start + page].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
