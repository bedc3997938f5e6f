"""The byte layout of one stored KV page: a 48-byte header, then the payload.

The payload is one page of KV for every layer, C-contiguous, in the KV dtype::

    [num_layers, 2 (K then V), num_kv_heads, page_size, head_dim]

Layer-major, so a loader can hand a page to the device layer by layer. The header (little
endian) lets a reader refuse anything that is not exactly the page it asked for::

    magic "RXKV" | format version u16 | header size u16 | layout id 8B | key 16B
    | payload size u64 | XXH3-64 of the payload u64

A truncated file, a page of another model or layout, a page stored under the wrong name, a
flipped bit: each fails ``check_page`` with ``PageFormatError`` saying which check failed.
XXH3-64 guards against corruption, not an adversary; it runs at ~30 GB/s here (zlib's CRC-32
at 1-3 GB/s took half the time of a page load).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"RXKV"
FORMAT_VERSION = 1
KEY_BYTES = 16
_HEADER = struct.Struct("<4sHH8s16sQQ")
HEADER_BYTES = _HEADER.size  # 48

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PageFormatError(ValueError):
    """A stored page failed a check: it must not be used (and should be deleted)."""


@dataclass(frozen=True)
class PageLayout:
    """What one page holds; two layouts with equal fields store interchangeable pages."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # "float32", "bfloat16" or "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PageLayout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"PageLayout.dtype must be one of {sorted(_DTYPES)}: {self.dtype!r}")

    @classmethod
    def from_shape(cls, shape, page_size: int) -> PageLayout:
        """From a ``KVShape`` (num_layers, num_kv_heads, head_dim, torch dtype)."""
        dtype = str(shape.dtype).removeprefix("torch.")
        return cls(shape.num_layers, shape.num_kv_heads, shape.head_dim, page_size, dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.page_size, self.head_dim)

    # cached: these are read for every page moved
    @functools.cached_property
    def page_nbytes(self) -> int:
        return math.prod(self.page_shape) * _ELEMENT_BYTES[self.dtype]

    @functools.cached_property
    def descriptor(self) -> str:
        """Canonical text naming the layout (and the payload order, via the format version)."""
        return (
            f"rxkv{FORMAT_VERSION}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":P{self.page_size}:{self.dtype}"
        )

    @functools.cached_property
    def layout_id(self) -> bytes:
        return hashlib.blake2b(self.descriptor.encode(), digest_size=8).digest()

    @functools.cached_property
    def record_nbytes(self) -> int:
        """Size of a stored page: header plus payload."""
        return HEADER_BYTES + self.page_nbytes


def pack_header(layout: PageLayout, key: bytes, payload) -> bytes:
    """The header for ``payload`` (any buffer of ``layout.page_nbytes`` bytes) stored as ``key``."""
    view = memoryview(payload).cast("B")
    if len(view) != layout.page_nbytes:
        raise ValueError(f"a page payload must be {layout.page_nbytes} bytes, got {len(view)}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"a page key must be {KEY_BYTES} bytes, got {len(key)}")
    return _HEADER.pack(
        MAGIC, FORMAT_VERSION, HEADER_BYTES, layout.layout_id, key, len(view), _digest(view)
    )


def check_page(layout: PageLayout, key: bytes, record) -> memoryview:
    """The payload of ``record`` (header + payload) if it is exactly page ``key``; else raise."""
    view = memoryview(record).cast("B")
    if len(view) < HEADER_BYTES:
        raise PageFormatError(f"truncated: {len(view)} bytes, shorter than the header")
    magic, version, header_size, layout_id, stored_key, size, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise PageFormatError("not a radixserve KV page (bad magic)")
    if version != FORMAT_VERSION or header_size != HEADER_BYTES:
        raise PageFormatError(f"page format version {version} (this build reads {FORMAT_VERSION})")
    if layout_id != layout.layout_id:
        raise PageFormatError("page of another KV layout")
    if stored_key != key:
        raise PageFormatError("page stored under another key")
    if size != layout.page_nbytes or len(view) != HEADER_BYTES + size:
        raise PageFormatError(
            f"wrong size: {len(view) - HEADER_BYTES} payload bytes, expected {layout.page_nbytes}"
        )
    payload = view[HEADER_BYTES:]
    if _digest(payload) != digest:
        raise PageFormatError("checksum mismatch (corrupt payload)")
    return payload


def _digest(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)
