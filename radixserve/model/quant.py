"""Weights kept block-quantized (``--quantization``), and the matmul that uses them.

A ``QuantizedWeight`` is a matrix ``[N, K]`` in one of these formats (``fmt``):

- ``q8_0``: ``w = d * q`` with ``q`` int8, one scale per block of 32 inputs; 8.5 bits a weight.
- ``q4_1``: ``w = d * q + m`` with ``q`` in 0..15; 5 bits a weight here (GGUF's Q4_0,
  ``w = d * (q - 8)``, is the same with ``m = -8 d`` and loads as q4_1).
  These two hold ``qs`` (the codes: int8 ``[N, K]`` or nibble pairs uint8 ``[N, K/2]`` in
  GGUF's order: byte ``j`` of a block holds input ``j`` in its low nibble and input ``j + 16``
  in its high nibble) and float32 ``d`` (and ``m``) ``[N, K/32]``.
- GGUF's own block formats ``q5_0``, ``q5_1``, ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k``,
  ``q6_k``: ``qs`` is the file's bytes, uint8 ``[N, row bytes]`` (a view of the memory-mapped
  file where it can be: nothing is converted or copied at load). ``csrc/block_formats.cpp``
  documents their layouts.
- ``stack``: the rows of ``parts`` one after another: a fused QKV or gate/up matrix whose
  pieces come in different formats (Q4_K_M files mix Q5_0 and Q8_0 in one layer's Q/K/V) or
  in file bytes that are not copied to be joined.

``matmul`` computes ``x @ W^T``: on CPU with the native kernels, small row counts run on the
quantized blocks directly (a weight holding GGUF block formats: up to a few hundred rows,
prompt chunks included, 8 rows or more with x rounded to int8 per block, as llama.cpp
computes every matmul; ``RADIXSERVE_INT8_LANES=0`` keeps x in float) and larger ones
dequantize once into a matrix for BLAS;
elsewhere (no kernels, CUDA) it dequantizes with PyTorch ops (or the ``gguf`` package, for
its block formats). Every path computes the same function as the dequantized model, up to
float summation order and x's rounding to int8: the quantized model *is* the file's model,
nothing is approximated beyond the file's own rounding and that of x.

``--quantization``: ``auto`` keeps every quantized type of a GGUF file listed above as it is
and loads the rest (F16, BF16, F32) in the model dtype; a Hugging Face directory loads dense.
``none`` dequantizes everything (the reference). ``int8`` / ``int4`` quantize every linear
layer to q8_0 / q4_1 (tensors already in that format are kept; the embedding and LM head are
q8_0 under ``int4``, where 4 bits hurt most).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.model import native

QUANTIZATIONS = ("auto", "none", "int8", "int4")
BLOCK = 32
# the native kernels' WFormat
FORMAT_CODES = {"q8_0": 1, "q4_1": 2, "q5_0": 3, "q5_1": 4, "q2_k": 5, "q3_k": 6, "q4_k": 7,
                "q5_k": 8, "q6_k": 9}  # fmt: skip
# GGUF block formats kept as the file's bytes: (inputs, bytes) of one block
GGUF_BLOCKS = {"q5_0": (32, 22), "q5_1": (32, 24), "q2_k": (256, 84), "q3_k": (256, 110),
               "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}  # fmt: skip
# Up to this many rows of x the native kernels beat dequantizing the matrix for BLAS: Q8_0 /
# Q4_1 64 rows (float32), 16 where bfloat16 matmuls are native (dequantizing them is cheap:
# SmolLM2-135M's step ~40 ms, 2 threads). The GGUF block formats cost ~4x more per weight to
# dequantize (Qwen2.5-0.5B Q4_K_M: ~0.5 s a step's matrices), so the kernels win up to 128
# rows on the float path and 384 with x rounded to int8 (half the time per row; a weight
# ``int8_lanes`` takes, the switch on), which such weights then use from 8 rows on.
SMALL_M = {torch.float32: 64}
SMALL_M_OTHER = 16
SMALL_M_BLOCKS = 128
INT8_M_BLOCKS = 384


@dataclass
class QuantizedWeight:
    fmt: str  # see the module's docstring
    qs: torch.Tensor
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None
    parts: tuple[QuantizedWeight, ...] = ()  # a stack's pieces
    _native: Any = None  # the kernels' QWeight view, made on first native use

    @property
    def shape(self) -> tuple[int, int]:
        if self.fmt == "stack":
            return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]
        n = self.qs.shape[0]
        if self.fmt in GGUF_BLOCKS:
            inputs, size = GGUF_BLOCKS[self.fmt]
            return n, self.qs.shape[1] // size * inputs
        return n, self.d.shape[1] * BLOCK

    @property
    def device(self) -> torch.device:
        return self.parts[0].device if self.fmt == "stack" else self.qs.device

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding the weight (codes and scales; a stack's pieces')."""
        if self.fmt == "stack":
            return [t for p in self.parts for t in p.tensors()]
        return [t for t in (self.qs, self.d, self.m) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device) -> QuantizedWeight:
        if self.fmt == "stack":
            return QuantizedWeight.cat([p.to(device) for p in self.parts])
        d, m = (None if t is None else t.to(device) for t in (self.d, self.m))
        return QuantizedWeight(self.fmt, self.qs.to(device), d, m)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows ``index`` of W (a permutation, or the embedding rows of some tokens)."""
        if self.fmt == "stack":
            raise ValueError("rows of a stacked weight: take them before stacking")
        d, m = (None if t is None else t[index] for t in (self.d, self.m))
        return QuantizedWeight(self.fmt, self.qs[index], d, m)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack the rows of several matrices (fused QKV, gate/up): Q8_0 / Q4_1 ones of one
        format are joined into one matrix, anything else is stacked without a copy."""
        flat = [q for p in parts for q in (p.parts if p.fmt == "stack" else (p,))]
        if len({p.shape[1] for p in flat}) != 1:
            raise ValueError("can only stack weights with the same inputs")
        fmts = {p.fmt for p in flat}
        if len(flat) == 1:
            return flat[0]
        if len(fmts) > 1 or fmts & GGUF_BLOCKS.keys():
            return QuantizedWeight("stack", torch.empty(0, dtype=torch.uint8), parts=tuple(flat))
        m = None if flat[0].m is None else torch.cat([p.m for p in flat])
        return replace(flat[0], qs=torch.cat([p.qs for p in flat]),
                       d=torch.cat([p.d for p in flat]), m=m, _native=None)  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        ops = self.native_ops()
        if ops is not None:
            return ops.dequantize(self.native_view()).to(dtype)
        if self.fmt == "stack":
            return torch.cat([p.dequantize(dtype) for p in self.parts])
        if self.fmt in GGUF_BLOCKS:
            import gguf

            qtype = gguf.GGMLQuantizationType[self.fmt.upper()]
            w = gguf.quants.dequantize(self.qs.cpu().numpy(), qtype).reshape(n, k)
            return torch.from_numpy(np.asarray(w, dtype=np.float32)).to(self.device, dtype)
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
        if ops is not None:
            blocks = self.fmt in GGUF_BLOCKS or any(p.fmt in GGUF_BLOCKS for p in self.parts)
            int8 = blocks and ops.use_int8_lanes() and self.native_view().int8_lanes
            if x.shape[0] <= self._native_rows(x.dtype, blocks, int8):
                y = ops.qgemm(x.float().contiguous(), self.native_view(), int8=int8).to(x.dtype)
                return y if residual is None else residual + y
        return _dense_matmul(x, self.dequantize(x.dtype), residual)

    @staticmethod
    def _native_rows(dtype: torch.dtype, blocks: bool, int8: bool) -> int:
        """The most rows of x that ``matmul`` multiplies on the blocks directly."""
        if blocks:
            return INT8_M_BLOCKS if int8 else SMALL_M_BLOCKS
        return SMALL_M.get(dtype, SMALL_M_OTHER)

    def native_ops(self) -> Any | None:
        return native.paged_ops() if self.device.type == "cpu" else None

    def native_view(self) -> Any:
        if self._native is None:
            ops = native.paged_ops()
            n, k = self.shape
            if self.fmt == "stack":
                self._native = ops.QWeight.stack([p.native_view() for p in self.parts])
            else:
                code = FORMAT_CODES[self.fmt]
                self._native = ops.QWeight(code, n, k, self.qs, self.d, self.m)
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
_SPLIT_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
# GGUF tensor types kept as they are under "auto"
GGUF_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_1", "Q4_1": "q4_1",
                **{f.upper(): f for f in GGUF_BLOCKS}}  # fmt: skip
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
    """A GGUF tensor's bytes (``[N, row bytes]``) of a type in ``GGUF_FORMATS`` as a weight;
    a block format's bytes are used in place (``raw`` may be a view of the mapped file)."""
    n, k = shape
    fmt = GGUF_FORMATS[type_name]
    if fmt in GGUF_BLOCKS:
        inputs, size = GGUF_BLOCKS[fmt]
        with warnings.catch_warnings():  # a read-only map: the kernels never write to it
            warnings.simplefilter("ignore", UserWarning)
            qs = torch.from_numpy(np.asarray(raw, dtype=np.uint8).reshape(n, k // inputs * size))
        return QuantizedWeight(fmt, qs)
    size = _SPLIT_BLOCK_BYTES[type_name]
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
