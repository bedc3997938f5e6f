"""Chained block hashes: the one definition both the engine's tree and routers use.

A block is ``block_size`` consecutive tokens of a sequence, aligned to the sequence start.
Block ``i``'s hash is blake2b(8 bytes) over the hash of block ``i - 1`` (nothing for the first
block), the namespace salt (length-prefixed, so no namespace's salt plus tokens can equal
another's) and the block's token ids as little-endian int32. Equal hashes therefore mean an
equal whole prefix in the same namespace, on any instance of the same model. A namespace is
the engine's ``namespace`` (a tenant or ``cache_salt``, as the server maps it): any value
with a stable ``repr``; ``None`` is the shared namespace.

Hashes are unsigned 64-bit integers (vLLM's ``ExternalBlockHash`` as an int).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

DEFAULT_MIN_BLOCK_TOKENS = 16


def default_block_size(page_size: int) -> int:
    """The smallest multiple of ``page_size`` holding at least 16 tokens (vLLM's block)."""
    return page_size * -(-DEFAULT_MIN_BLOCK_TOKENS // page_size)


def namespace_salt(namespace: Any) -> bytes:
    if namespace is None:
        return b""
    salt = repr(namespace).encode()
    return len(salt).to_bytes(4, "little") + salt


def chain_block_hashes(
    parent_hash: int | None,
    tokens: np.ndarray | Sequence[int],
    block_size: int,
    namespace: Any = None,
    salt: bytes | None = None,
) -> list[int]:
    """Hashes of the whole blocks of ``tokens`` (which start at a block boundary), each
    chained to the one before it; ``parent_hash`` is the hash of the block before the first."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    salt = namespace_salt(namespace) if salt is None else salt
    step = 4 * block_size
    hashes = []
    prev = b"" if parent_hash is None else parent_hash.to_bytes(8, "little")
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(salt)
        h.update(data[start : start + step])
        prev = h.digest()
        hashes.append(int.from_bytes(prev, "little"))
    return hashes


def prompt_block_hashes(
    token_ids: np.ndarray | Sequence[int], block_size: int, namespace: Any = None
) -> list[int]:
    """The hashes of every whole block of a prompt, from its first token."""
    return chain_block_hashes(None, token_ids, block_size, namespace)
