"""The byte layout of one stored KV page (a storage block): a header, then the payload.

The payload is one page of KV, C-contiguous, rows in the KV format (``kv_format.py``: values of
a float dtype, or int8 codes followed by their float16 scales)::

    [layers, 2 (K then V), num_kv_heads, page_size, row_bytes]

Layer-major, so a loader can hand a page to the device layer by layer. ``layers`` is every
layer of the model, in order, or, for a model with sliding-window layers
(``PageLayout.window_layers``), possibly its global layers only: a page written from a host
copy of a tombstone (a node whose window layers' KV was dropped) has no window KV to store.
The header's flag says which (``window``).

A page carries one flag, so a storage block is stored with window KV only when every token
in it has that KV in its host copy; a block spanning a node with window KV and a tombstone's
copy is stored with its global layers only (its window part does not reach storage), and
reads back as a tombstone. With a storage tier the default write policy copies every node to
the host as it is computed (``write_through``), with its window KV, so mixed blocks arise only
next to copies that lacked it (a ``write_back`` copy of a tombstone, a block read back
without it). One flag keeps a stored block one record of one of two sizes, whatever the page
size that wrote or reads it.

The header (little endian) lets a reader refuse anything that is not exactly the page it
asked for. A layout without window layers writes format version 1 (48 bytes), one with them
version 2 (56 bytes, the flag byte added)::

    magic "RXKV" | format version u16 | header size u16 | layout id 8B | key 16B
    | payload size u64 | XXH3-64 of the payload u64
    [version 2: | flags u8 (bit 0: window) | 7 zero bytes]

The version is part of the layout's name (``descriptor``), so pages of a model without window
layers keep the keys and bytes they had before version 2 existed.

A truncated file, a page of another format version, model or layout, a page stored under the
wrong name, a payload whose size is not the one its flag says, a flag that the layout cannot
have, a flipped bit: each fails ``check_page`` with ``PageFormatError`` saying which check
failed. XXH3-64 guards against corruption, not an adversary; it runs at ~30 GB/s here (zlib's
CRC-32 at 1-3 GB/s took half the time of a page load).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from radixserve.cache.kv_format import KVFormat

MAGIC = b"RXKV"
KEY_BYTES = 16
# format version -> header: version 1 for layouts without window layers, 2 with them
_HEADERS = {1: struct.Struct("<4sHH8s16sQQ"), 2: struct.Struct("<4sHH8s16sQQB7x")}
_PREFIX = struct.Struct("<4sH")  # magic, format version
WINDOW_FLAG = 1


class PageFormatError(ValueError):
    """A stored page failed a check: it must not be used (and should be deleted)."""


@dataclass(frozen=True)
class PageLayout:
    """What one page holds; two layouts with equal fields store interchangeable pages."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # the KV format's name (``KVFormat.name``): "float32", "bfloat16", "int8g16", ...
    window_layers: tuple[int, ...] = ()  # sliding-window layers: a page may be stored without

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PageLayout.{name} must be a positive integer, got {value!r}")
        try:
            KVFormat.parse(self.dtype).check_dim(self.head_dim)
        except ValueError as e:
            raise ValueError(f"PageLayout.dtype {self.dtype!r}: {e}") from None
        window = tuple(self.window_layers)
        if list(window) != sorted(set(window)) or not set(window) <= set(range(self.num_layers)):
            raise ValueError(
                f"PageLayout.window_layers must be distinct layer indices in increasing order "
                f"below {self.num_layers}, got {self.window_layers!r}"
            )
        object.__setattr__(self, "window_layers", window)

    @classmethod
    def from_shape(cls, shape, page_size: int) -> PageLayout:
        """From a ``KVShape`` (num_layers, num_kv_heads, head_dim, KV format, window layers)."""
        dtype = shape.kv_format.name
        return cls(shape.num_layers, shape.num_kv_heads, shape.head_dim, page_size, dtype,
                   tuple(shape.window_layers))  # fmt: skip

    @functools.cached_property
    def format(self) -> KVFormat:
        return KVFormat.parse(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of a page tensor (bytes for int8 rows)."""
        return self.format.storage_dtype

    @property
    def page_shape(self) -> tuple[int, ...]:
        """A page with every layer (what host memory holds), in ``torch_dtype``."""
        width = self.format.row_width(self.head_dim)
        return (self.num_layers, 2, self.num_kv_heads, self.page_size, width)

    def stored_layers(self, window: bool) -> slice | np.ndarray:
        """The layers a payload holds: every one, or (``window`` False) the global ones."""
        return stored_layers(self.num_layers, self.window_layers, window)

    def payload_nbytes(self, window: bool) -> int:
        """Size of a payload with every layer, or (``window`` False) the global ones only."""
        layers = self.num_layers if window else self.num_layers - len(self.window_layers)
        return self.page_nbytes // self.num_layers * layers

    # cached: these are read for every page moved
    @functools.cached_property
    def page_nbytes(self) -> int:
        """Size of a page with every layer."""
        return math.prod(self.page_shape[:-1]) * self.format.row_bytes(self.head_dim)

    @property
    def format_version(self) -> int:
        """The page format: 1 (no flag, every layer) without window layers, 2 with them."""
        return 2 if self.window_layers else 1

    @property
    def header_nbytes(self) -> int:
        return _HEADERS[self.format_version].size

    @functools.cached_property
    def descriptor(self) -> str:
        """Canonical text naming the layout (and the payload order, via the format version)."""
        window = f":W{','.join(map(str, self.window_layers))}" if self.window_layers else ""
        return (
            f"rxkv{self.format_version}:L{self.num_layers}:H{self.num_kv_heads}"
            f":D{self.head_dim}:P{self.page_size}:{self.dtype}{window}"
        )

    @functools.cached_property
    def layout_id(self) -> bytes:
        return hashlib.blake2b(self.descriptor.encode(), digest_size=8).digest()

    @functools.cached_property
    def record_nbytes(self) -> int:
        """Size of a stored page with every layer: header plus payload (the largest)."""
        return self.header_nbytes + self.page_nbytes

    @functools.cached_property
    def record_sizes(self) -> frozenset[int]:
        """The sizes a stored page of this layout can have (with and without window KV)."""
        return frozenset(self.header_nbytes + self.payload_nbytes(w) for w in self.flags)

    @property
    def flags(self) -> tuple[bool, ...]:
        """The ``window`` values a page of this layout can carry."""
        return (True, False) if self.window_layers else (True,)


def stored_layers(num_layers: int, window_layers: Sequence[int],
                  window: bool) -> slice | np.ndarray:  # fmt: skip
    """Indices into a page's layer axis: every layer, or (``window`` False) the global ones."""
    if window:
        return slice(None)
    skip = set(window_layers)
    return np.array([i for i in range(num_layers) if i not in skip], dtype=np.int64)


def pack_header(layout: PageLayout, key: bytes, payload, window: bool = True) -> bytes:
    """The header for ``payload`` stored as ``key``: every layer's KV (``window``), or the
    global layers' only; ``payload`` is any buffer of ``layout.payload_nbytes(window)``."""
    view = memoryview(payload).cast("B")
    if window not in layout.flags:
        raise ValueError("a page without window KV in a layout without window layers")
    if len(view) != layout.payload_nbytes(window):
        raise ValueError(
            f"a page payload must be {layout.payload_nbytes(window)} bytes, got {len(view)}"
        )
    if len(key) != KEY_BYTES:
        raise ValueError(f"a page key must be {KEY_BYTES} bytes, got {len(key)}")
    version = layout.format_version
    fields = [MAGIC, version, layout.header_nbytes, layout.layout_id, key, len(view), _digest(view)]
    if version == 2:
        fields.append(WINDOW_FLAG if window else 0)
    return _HEADERS[version].pack(*fields)


def check_page(layout: PageLayout, key: bytes, record) -> tuple[memoryview, bool]:
    """The payload of ``record`` (header + payload) if it is exactly page ``key``, and whether
    it holds the window layers' KV (every layer); else raise ``PageFormatError``."""
    view = memoryview(record).cast("B")
    header = layout.header_nbytes
    if len(view) < header:
        raise PageFormatError(f"truncated: {len(view)} bytes, shorter than the header")
    magic, version = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise PageFormatError("not a radixserve KV page (bad magic)")
    if version != layout.format_version:
        raise PageFormatError(
            f"page format version {version} (this layout's pages are version "
            f"{layout.format_version})"
        )
    fields = _HEADERS[version].unpack_from(view)
    header_size, layout_id, stored_key, size, digest = fields[2:7]
    flags = fields[7] if version == 2 else WINDOW_FLAG  # version 1: every layer, no flag
    if header_size != header:
        raise PageFormatError(f"header of {header_size} bytes, expected {header}")
    if layout_id != layout.layout_id:
        raise PageFormatError("page of another KV layout")
    if stored_key != key:
        raise PageFormatError("page stored under another key")
    window = bool(flags & WINDOW_FLAG)
    if flags & ~WINDOW_FLAG or window not in layout.flags:
        raise PageFormatError(f"flags {flags:#x} that this layout cannot have")
    expected = layout.payload_nbytes(window)
    if size != expected or len(view) != header + size:
        got = len(view) - header
        raise PageFormatError(f"wrong size: {got} payload bytes, expected {expected}")
    payload = view[header:]
    if _digest(payload) != digest:
        raise PageFormatError("checksum mismatch (corrupt payload)")
    return payload, window


def _digest(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)
