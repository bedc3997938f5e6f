"""The KV format: the bytes of one token's K (or V) for one head of one layer (a *row*).

This is the one description of how KV is stored. The device pool (``kv_pool.py``), host pages
(``host_pool.py``), stored pages (``storage/page_format.py``), the prefill/decode transfer
wire (``disagg/``) and the native kernels (``model/csrc``, ``KVType``) all derive what they
store from a ``KVFormat``: its dtype, element size, scales and row size. A new format is a
change here (and in the kernels' row reader), not in each of them.

- ``float32``, ``bfloat16``, ``float16``: a row is ``head_dim`` values of that dtype.
- ``int8``: a row is ``head_dim`` int8 codes, then one float16 scale per ``group`` channels:
  value = code * scale, with scale = max|x| / 127 over the group (per token, per head) and
  code = round(x / scale) (ties to even), clipped to [-127, 127]. The scale is rounded to
  float16 before the codes are computed, so a row decodes to exactly what its codes say.
  Groups of 16 channels: measured against groups of 32 (llama.cpp's ``q8_0``) and one scale
  per head on Qwen2.5, whose keys have a few very large channels (docs/decisions.md).

Every format has a byte view: a pool layer ``[heads, slots, row_bytes]`` of ``uint8``
(``as_rows``), which is what pages and the wire move; float formats keep their natural
tensors ``[heads, slots, head_dim]`` of their dtype, whose bytes are the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "int8")  # the engine's --kv-cache-dtype choices
INT8_GROUP = 16
# the native kernels' KVType (csrc/kernels.h), in this order
_KERNEL_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3}


@dataclass(frozen=True)
class KVFormat:
    """How one row of KV is stored: ``dtype`` values (and, for int8, float16 scales, one per
    ``group`` channels)."""

    dtype: str  # "float32", "bfloat16", "float16" or "int8"
    group: int = 0  # int8: channels per scale; 0 for float formats

    def __post_init__(self) -> None:
        if self.dtype not in (*FLOAT_DTYPES, "int8"):
            raise ValueError(f"unknown KV dtype {self.dtype!r}")
        if self.quantized != (self.group > 0):
            raise ValueError(f"KV format {self.dtype}: group {self.group} (int8 needs one)")
        if self.quantized and self.group % 16:
            raise ValueError(
                f"int8 KV scales groups of a multiple of 16 channels, not {self.group}"
            )

    @classmethod
    def of(cls, dtype: torch.dtype | str) -> KVFormat:
        """The plain format of a torch dtype, or ``int8`` with its default group."""
        name = str(dtype).removeprefix("torch.")
        return cls("int8", INT8_GROUP) if name == "int8" else cls(name)

    @classmethod
    def parse(cls, name: str) -> KVFormat:
        """The format of a canonical name (``name``): ``float32``, ``int8g16``, ..."""
        if name.startswith("int8g") and name[5:].isdigit():
            return cls("int8", int(name[5:]))
        return cls(name)

    @property
    def quantized(self) -> bool:
        return self.dtype == "int8"

    @property
    def name(self) -> str:
        """Canonical text (page descriptors, logs): ``float32``, ``int8g16``, ..."""
        return f"int8g{self.group}" if self.quantized else self.dtype

    @property
    def element_size(self) -> int:
        return 1 if self.quantized else FLOAT_DTYPES[self.dtype].itemsize

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of a pool tensor in this format (rows of bytes for int8)."""
        return torch.uint8 if self.quantized else FLOAT_DTYPES[self.dtype]

    @property
    def kernel_code(self) -> int:
        return _KERNEL_CODES[self.dtype]

    def check_dim(self, head_dim: int) -> None:
        if self.quantized and head_dim % self.group:
            raise ValueError(
                f"head_dim {head_dim} is not a multiple of the int8 group {self.group}"
            )

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one row: the values, then (int8) the scales."""
        self.check_dim(head_dim)
        scales = 2 * (head_dim // self.group) if self.quantized else 0
        return head_dim * self.element_size + scales

    def row_width(self, head_dim: int) -> int:
        """Last dimension of a pool tensor: ``head_dim`` values, or (int8) the row's bytes."""
        return self.row_bytes(head_dim) if self.quantized else head_dim

    def as_rows(self, t: torch.Tensor) -> torch.Tensor:
        """A pool tensor (last dim ``row_width``) as bytes ``[..., row_bytes]``, no copy."""
        return t if self.quantized else t.view(torch.uint8)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Values ``[..., head_dim]`` as stored: this format's tensor ``[..., row_width]``."""
        if not self.quantized:
            return x.to(FLOAT_DTYPES[self.dtype])
        head_dim = x.shape[-1]
        self.check_dim(head_dim)
        g = x.float().reshape(*x.shape[:-1], head_dim // self.group, self.group)
        scale = (g.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
        s = scale.float()
        codes = torch.where(s > 0, g / s, 0.0).round_().clamp_(-127, 127).to(torch.int8)
        rows = torch.cat([codes.view(torch.uint8).flatten(-2),
                          scale.view(torch.uint8).flatten(-2)], dim=-1)  # fmt: skip
        return rows

    def round_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries ``[..., head_dim]`` as attention over this format scores them: for int8, each
        group of channels rounded to int8 codes times a float32 scale (max|q| / 127), so the
        native kernels take the dot products in integers (``csrc/flash_i8.cpp``) and the
        PyTorch path computes the same scores; float formats: ``q`` itself."""
        if not self.quantized:
            return q
        g = q.float().reshape(*q.shape[:-1], q.shape[-1] // self.group, self.group)
        s = g.abs().amax(-1, keepdim=True) / 127
        codes = torch.where(s > 0, g / s, 0.0).round_().clamp_(-127, 127)
        return (codes * s).flatten(-2).to(q.dtype)

    def decode(self, rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """Stored ``[..., row_width]`` back to values ``[..., head_dim]`` of ``dtype``."""
        if not self.quantized:
            return rows.to(dtype)
        n = head_dim // self.group
        codes = rows[..., :head_dim].view(torch.int8).float()
        scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
        values = codes.view(*codes.shape[:-1], n, self.group) * scale[..., None]
        return values.flatten(-2).to(dtype)
