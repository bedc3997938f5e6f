"""Weights kept block-quantized (``--quantization``), and the matmul that uses them.

Two formats, both GGUF's own, one scale per block of 32 consecutive inputs of a row:

- ``q8_0``: ``w = d * q`` with ``q`` int8; 8.5 bits a weight.
- ``q4_1``: ``w = d * q + m`` with ``q`` in 0..15; 5 bits a weight here (GGUF's Q4_0,
  ``w = d * (q - 8)``, is the same with ``m = -8 d`` and loads as q4_1).

A ``QuantizedWeight`` holds ``qs`` (the codes: int8 ``[N, K]`` or nibble pairs uint8
``[N, K/2]`` in GGUF's order: byte ``j`` of a block holds input ``j`` in its low nibble and
input ``j + 16`` in its high nibble) and float32 ``d`` (and ``m``) ``[N, K/32]``. ``matmul``
computes ``x @ W^T``: on CPU with the native kernels, small row counts (decode) run on the
quantized blocks directly and larger ones dequantize once into a matrix for BLAS; elsewhere
(no kernels, CUDA) it dequantizes with PyTorch ops. Every path computes the same function as
the dequantized model, up to float summation order: the quantized model *is* the file's
model, nothing is approximated beyond the file's own rounding.

``--quantization``: ``auto`` keeps a GGUF file's Q8_0/Q4_0/Q4_1 tensors as they are and
dequantizes other types (F16, K-quants) to the model dtype; a Hugging Face directory loads
dense. ``none`` dequantizes everything (the reference). ``int8`` / ``int4`` quantize every
linear layer to q8_0 / q4_1 (tensors already in that format are kept; the embedding and LM
head are q8_0 under ``int4``, where 4 bits hurt most).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.model import native

QUANTIZATIONS = ("auto", "none", "int8", "int4")
BLOCK = 32
FORMAT_CODES = {"q8_0": 1, "q4_1": 2}  # the native kernels' WFormat
# Up to this many rows of x the native kernels beat dequantize + BLAS (float32 here; where
# bfloat16 matmuls are native, BLAS wins sooner).
SMALL_M = {torch.float32: 64}
SMALL_M_OTHER = 16


@dataclass
class QuantizedWeight:
    fmt: str  # "q8_0" or "q4_1"
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    _native: Any = None  # the kernels' QWeight view, made on first native use

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        return n, self.d.shape[1] * BLOCK

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def nbytes(self) -> int:
        parts = (self.qs, self.d, self.m) if self.m is not None else (self.qs, self.d)
        return sum(t.numel() * t.element_size() for t in parts)

    def to(self, device: torch.device) -> QuantizedWeight:
        m = None if self.m is None else self.m.to(device)
        return QuantizedWeight(self.fmt, self.qs.to(device), self.d.to(device), m)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows ``index`` of W (a permutation, or the embedding rows of some tokens)."""
        m = None if self.m is None else self.m[index]
        return QuantizedWeight(self.fmt, self.qs[index], self.d[index], m)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack the rows of several matrices of one format (fused QKV, gate/up)."""
        if len({p.fmt for p in parts}) != 1:
            raise ValueError("can only fuse weights of one format")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return replace(parts[0], qs=torch.cat([p.qs for p in parts]),
                       d=torch.cat([p.d for p in parts]), m=m, _native=None)  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        ops = self.native_ops()
        if ops is not None:
            return ops.dequantize(self.native_view()).to(dtype)
        blocks = self.qs.view(n, k // BLOCK, -1)
        if self.fmt == "q8_0":
            w = blocks.float() * self.d[..., None]
        else:
            q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).float()
            w = q * self.d[..., None] + self.m[..., None]
        return w.reshape(n, k).to(dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ops = self.native_ops()
        if ops is not None:
            return ops.dequantize(self.native_view(), ids.contiguous()).to(dtype)
        return self.rows(ids).dequantize(dtype)

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T`` (``+ residual``) for ``x`` ``[M, K]``, in ``x``'s dtype."""
        ops = self.native_ops()
        if ops is not None and x.shape[0] <= SMALL_M.get(x.dtype, SMALL_M_OTHER):
            y = ops.qgemm(x.float().contiguous(), self.native_view()).to(x.dtype)
            return y if residual is None else residual + y
        return _dense_matmul(x, self.dequantize(x.dtype), residual)

    def native_ops(self) -> Any | None:
        return native.paged_ops() if self.device.type == "cpu" else None

    def native_view(self) -> Any:
        if self._native is None:
            n, k = self.shape
            self._native = native.paged_ops().QWeight(
                FORMAT_CODES[self.fmt], n, k, self.qs, self.d, self.m
            )
        return self._native


def linear(
    x: torch.Tensor,
    w: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias + residual`` (each optional); the residual is added inside the matmul
    (BLAS's beta) where it can be, instead of by another pass over the output."""
    if bias is not None:
        y = F.linear(x, w, bias) if isinstance(w, torch.Tensor) else w.matmul(x) + bias
        return y if residual is None else residual + y
    if isinstance(w, torch.Tensor):
        return _dense_matmul(x, w, residual)
    return w.matmul(x, residual)


def _dense_matmul(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    if residual is None:
        return F.linear(x, w)
    return torch.addmm(residual, x, w.t())


# ---------------------------------------------------------------------- making them
_GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
GGUF_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_1", "Q4_1": "q4_1"}  # kept as they are
_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def target_format(
    name: str, shape: tuple[int, ...], quantization: str, source: str | None = None
) -> str | None:
    """The format weight ``name`` is kept in under ``quantization``, or None: dense.

    ``source``: the GGUF tensor type the weight comes in (None for dense files)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    is_embedding = name in _EMBEDDINGS
    if not (is_embedding or name.endswith("_proj.weight")) or len(shape) != 2:
        return None
    if shape[1] % BLOCK or quantization == "none":
        return None
    own = GGUF_FORMATS.get(source or "")
    if quantization == "auto":
        return own
    if quantization == "int8":
        return "q8_0"
    return (own or "q8_0") if is_embedding else "q4_1"


def quantize_dense(
    weights: dict[str, torch.Tensor], quantization: str
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Quantize a dense checkpoint's matrices as ``quantization`` says (int8, int4)."""
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, w in weights.items():
        fmt = target_format(name, tuple(w.shape), quantization)
        out[name] = w if fmt is None else quantize(w, fmt)
    return out


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF Q8_0 / Q4_0 / Q4_1 tensor's bytes (``[N, K/32 * block bytes]``) as a weight."""
    n, k = shape
    size = _GGUF_BLOCK_BYTES[type_name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        qs = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantizedWeight("q8_0", torch.from_numpy(qs), torch.from_numpy(d))
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:].reshape(n, k // 2).copy()
    else:  # Q4_0: d * (q - 8) == d * q + (-8 d)
        m = -8.0 * d
        qs = blocks[..., 2:].reshape(n, k // 2).copy()
    return QuantizedWeight("q4_1", torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m))


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round a dense ``[N, K]`` weight to ``fmt`` (GGUF's reference rounding)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"cannot quantize a weight with {k} inputs: not a multiple of {BLOCK}")
    blocks = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = blocks.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(blocks * inv[..., None]).to(torch.int8)
        return QuantizedWeight("q8_0", q.reshape(n, k).contiguous(), d.contiguous())
    if fmt != "q4_1":
        raise ValueError(f"unknown weight format {fmt!r}")
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.floor((blocks - lo[..., None]) * inv[..., None] + 0.5), 0, 15)
    q = q.to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return QuantizedWeight("q4_1", packed.reshape(n, k // 2).contiguous(), d.contiguous(),
                           lo.contiguous())  # fmt: skip
