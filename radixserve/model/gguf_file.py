"""A GGUF file read in one pass over its header and memory-mapped once for its tensors.

``gguf.GGUFReader`` makes a numpy view for every item of every metadata array, which for a
150k-token vocabulary (tokens, merges, token types) takes many seconds; this reader skips
over arrays, decoding an array's items only when ``contents()`` asks for them. It offers the
part of the reader's interface the loaders use: ``fields[key].contents()``, ``len(field.data)``
for arrays, and ``tensors`` with ``name``, ``shape`` (GGUF's order: inputs first),
``tensor_type`` and ``data``, a view of the mapped file shaped as the reader shapes it (a
quantized type's rows as their bytes), so nothing is read before it is used; ``release``
drops a copied tensor's pages from the process's resident memory.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = 0x46554747  # "GGUF", little-endian
# value types: struct format of the scalars (strings 8 and arrays 9 apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
           GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
           GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
           GGMLQuantizationType.I64: np.int64}  # fmt: skip


@dataclass
class Field:
    """One metadata value; arrays keep where their items lie and decode them on demand."""

    value: Any = None
    buf: Any = None
    item_type: int = -1  # arrays: the items' value type
    count: int = 0
    offset: int = 0  # arrays: where the first item starts

    @property
    def data(self) -> range | list:
        return range(self.count) if self.item_type >= 0 else [self.value]

    def contents(self) -> Any:
        if self.item_type < 0:
            return self.value
        if self.item_type == 8:
            out, pos = [], self.offset
            for _ in range(self.count):
                (n,) = struct.unpack_from("<Q", self.buf, pos)
                out.append(bytes(self.buf[pos + 8 : pos + 8 + n]).decode("utf-8", "replace"))
                pos += 8 + n
            return out
        fmt = _SCALARS[self.item_type]
        return list(struct.unpack_from(f"<{self.count}{fmt}", self.buf, self.offset))


@dataclass
class Tensor:
    name: str
    shape: np.ndarray  # GGUF's order: the inputs (ne0) first
    tensor_type: GGMLQuantizationType
    data: np.ndarray
    start: int  # where its bytes lie in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.pos = 0
        magic, version = self._unpack("<II")
        if magic != MAGIC or version not in (2, 3):
            raise ValueError(f"{self.path} is not a GGUF file (version 2 or 3)")
        n_tensors, n_fields = self._unpack("<QQ")
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = (
            int(self.fields["general.alignment"].value)
            if "general.alignment" in self.fields
            else 32
        )
        start = (self.pos + align - 1) // align * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return text

    def _value(self, kind: int) -> Field:
        if kind == 8:
            return Field(self._string())
        if kind in _SCALARS:
            return Field(self._unpack("<" + _SCALARS[kind])[0])
        if kind != 9:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        item_type, count = self._unpack("<IQ")
        field = Field(buf=self.buf, item_type=item_type, count=count, offset=self.pos)
        if item_type == 8:  # skip the strings: their lengths only
            pos, buf = self.pos, self.buf
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            self.pos = pos
        elif item_type in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item_type])
        else:
            raise ValueError(f"{self.path}: arrays of GGUF type {item_type} are not supported")
        return field

    def _tensor_info(self) -> tuple[str, np.ndarray, GGMLQuantizationType, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        dims = np.array(self._unpack(f"<{n_dims}Q"), dtype=np.uint64)
        kind, offset = self._unpack("<IQ")
        return name, dims, GGMLQuantizationType(kind), offset

    def _tensor(self, start: int, name: str, dims: np.ndarray, kind: GGMLQuantizationType,
                offset: int) -> Tensor:  # fmt: skip
        shape = [int(d) for d in reversed(dims)]  # numpy's order: the inputs last
        inputs, size = GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shape)) // inputs * size
        raw = self.buf[start + offset : start + offset + nbytes]
        if kind in _DTYPES:
            data = raw.view(_DTYPES[kind]).reshape(shape)
        else:  # the rows as their bytes
            data = raw.reshape(*shape[:-1], shape[-1] // inputs * size)
        return Tensor(name, dims, kind, data, start + offset, nbytes)

    def release(self, tensor: Tensor) -> None:
        """The tensor was copied out: let the OS drop its pages of the map from this process
        (they stay in the page cache; a later read of ``tensor.data`` reads them again)."""
        page = mmap.PAGESIZE
        lo = (tensor.start + page - 1) // page * page
        hi = (tensor.start + tensor.nbytes) // page * page
        handle = getattr(self.buf, "_mmap", None)
        if hi > lo and handle is not None and hasattr(mmap, "MADV_DONTNEED"):
            handle.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
