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
- int8 with a key order (``KeyOrder``): the keys' channels are stored permuted, per layer and
  KV head, so that each group of 16 holds channels of similar size, and divided by a power of
  two per channel that brings the largest down near the others (Qwen2's key biases put
  channels near 150 beside channels near 1; in one group the small ones would round to a few
  codes). ``encode``/``decode`` given ``keys_of`` (the layers the tensor holds) apply and undo
  it, so what comes back as values is in the model's order and scale; attention scores the
  rows as stored against queries in the same order times the same powers of two
  (``stored_queries``): every product ``q_c k_c`` is unchanged, exactly. Values are stored as
  computed.

Every format has a byte view: a pool layer ``[heads, slots, row_bytes]`` of ``uint8``
(``as_rows``), which is what pages and the wire move; float formats keep their natural
tensors ``[heads, slots, head_dim]`` of their dtype, whose bytes are the same rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "int8")  # the engine's --kv-cache-dtype choices
INT8_GROUP = 16
# the native kernels' KVType (csrc/kernels.h), in this order
_KERNEL_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3}


Layers = int | slice | torch.Tensor  # one layer, or the layers along a tensor's axis -4


class KeyOrder:
    """Per layer and KV head, how int8 rows store the key channels: stored channel ``c`` of
    head ``h`` in layer ``l`` is the model's channel ``perm[l, h, c]`` divided by
    ``scale[l, h, c]``, a power of two (exact in float arithmetic), and the queries are taken
    in the same order multiplied by it, so each product ``q_c k_c`` is unchanged. Compared and
    named by a digest of both (a stored page or a transfer peer with another order is another
    format)."""

    def __init__(self, perm: torch.Tensor, scale: torch.Tensor | None = None):
        """``scale``: per model channel (``perm``'s shape), powers of two; None: all 1."""
        perm = perm.to(torch.int64).cpu().contiguous()
        if perm.dim() != 3 or not torch.equal(
            perm.sort(-1).values, torch.arange(perm.shape[-1]).expand_as(perm)
        ):
            raise ValueError("a key order is a permutation of the channels per layer and head")
        scale = torch.ones(perm.shape) if scale is None else scale.float().cpu()
        if scale.shape != perm.shape or not bool((torch.frexp(scale).mantissa == 0.5).all()):
            raise ValueError("a key order's scales are powers of two, one per channel")
        self.perm = perm
        self.inverse = perm.argsort(-1)
        self.scale = scale.gather(-1, perm).contiguous()  # in the stored order
        data = perm.numpy().tobytes() + self.scale.numpy().tobytes()
        self.digest = hashlib.blake2b(data, digest_size=4).hexdigest()

    @staticmethod
    def by_pair_size(size: torch.Tensor) -> torch.Tensor:
        """A permutation ``[..., head_dim]`` from ``size`` ``[..., head_dim / 2]``, the size of
        each rotary pair of key channels ``(i, i + head_dim / 2)`` (RoPE moves a key's size
        between the two, never out of the pair): pairs largest first, each pair's two
        channels side by side, so a group of 16 holds 8 pairs of similar size whatever the
        position."""
        half = size.shape[-1]
        pairs = size.float().argsort(dim=-1, descending=True, stable=True)
        return torch.stack([pairs, pairs + half], -1).flatten(-2)

    @staticmethod
    def pair_scales(size: torch.Tensor) -> torch.Tensor:
        """Scales ``[..., head_dim]`` (model order) from pair sizes ``[..., head_dim / 2]``: the
        power of two that brings each pair down to between the median pair's size and twice
        it (1 for pairs below that), the same for both channels of a pair (RoPE commutes)."""
        typical = size.float().median(-1, keepdim=True).values.clamp(min=1e-3)
        f = torch.exp2(torch.log2((size.float() / typical).clamp(min=1)).floor())
        return torch.cat([f, f], -1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyOrder) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"KeyOrder({self.digest})"

    def to_stored(self, x: torch.Tensor, layers: Layers) -> torch.Tensor:
        """Keys ``[..., heads, n, head_dim]`` (layers along axis -4 when ``layers`` names
        several) in the model's channel order -> as stored."""
        return _take(x, self.perm[layers]) / _rows(self.scale[layers], x)

    def to_model(self, x: torch.Tensor, layers: Layers) -> torch.Tensor:
        """The inverse of ``to_stored``."""
        return _take(x * _rows(self.scale[layers], x), self.inverse[layers])

    def queries(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Queries ``[T, heads, head_dim]`` of ``layer`` in the stored order of their KV head's
        keys, times their scales (grouped query heads share a KV head)."""
        rep = q.shape[-2] // self.perm.shape[1]
        perm = self.perm[layer].repeat_interleave(rep, 0).to(q.device)
        scale = self.scale[layer].repeat_interleave(rep, 0).to(q.device, q.dtype)
        return q.gather(-1, perm.expand_as(q)) * scale

    def queries_to_model(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """The inverse of ``queries``."""
        rep = q.shape[-2] // self.perm.shape[1]
        inv = self.inverse[layer].repeat_interleave(rep, 0).to(q.device)
        scale = self.scale[layer].repeat_interleave(rep, 0).to(q.device, q.dtype)
        return (q / scale).gather(-1, inv.expand_as(q))


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[..., heads, n, d]`` with each head's last axis reordered by ``index[..., heads, d]``."""
    return x.gather(-1, index.to(x.device).unsqueeze(-2).expand(x.shape))


def _rows(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``scale[..., heads, d]`` broadcast over the rows of ``x[..., heads, n, d]``."""
    return scale.to(x.device, x.dtype).unsqueeze(-2)


@dataclass(frozen=True)
class KVFormat:
    """How one row of KV is stored: ``dtype`` values (and, for int8, float16 scales, one per
    ``group`` channels, and the keys' channel order)."""

    dtype: str  # "float32", "bfloat16", "float16" or "int8"
    group: int = 0  # int8: channels per scale; 0 for float formats
    key_order: KeyOrder | None = None  # int8: how keys' channels are stored; None: as computed

    def __post_init__(self) -> None:
        if self.dtype not in (*FLOAT_DTYPES, "int8"):
            raise ValueError(f"unknown KV dtype {self.dtype!r}")
        if self.quantized != (self.group > 0):
            raise ValueError(f"KV format {self.dtype}: group {self.group} (int8 needs one)")
        if self.key_order is not None and not self.quantized:
            raise ValueError(f"a key order is for int8 KV, not {self.dtype}")
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
        """The row layout of a canonical name (``name``): ``float32``, ``int8g16``,
        ``int8g16k<digest>`` (a key order: the rows' sizes are those of ``int8g16``; the
        order itself comes from the model, not from the name)."""
        base = name.split("k", 1)[0] if name.startswith("int8g") else name
        if base.startswith("int8g") and base[5:].isdigit():
            return cls("int8", int(base[5:]))
        return cls(name)

    def with_key_order(self, order: KeyOrder | None) -> KVFormat:
        """This int8 format with keys stored in ``order`` (a float format as it is)."""
        return KVFormat(self.dtype, self.group, order) if self.quantized else self

    @property
    def quantized(self) -> bool:
        return self.dtype == "int8"

    @property
    def name(self) -> str:
        """Canonical text (page descriptors, logs): ``float32``, ``int8g16``, ..."""
        if not self.quantized:
            return self.dtype
        order = f"k{self.key_order.digest}" if self.key_order is not None else ""
        return f"int8g{self.group}{order}"

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

    def encode(self, x: torch.Tensor, keys_of: Layers | None = None) -> torch.Tensor:
        """Values ``[..., head_dim]`` as stored: this format's tensor ``[..., row_width]``.
        ``keys_of``: ``x`` holds the keys ``[..., heads, n, head_dim]`` of these layers (stored
        in the key order, if any)."""
        if not self.quantized:
            return x.to(FLOAT_DTYPES[self.dtype])
        if keys_of is not None and self.key_order is not None:
            x = self.key_order.to_stored(x, keys_of)
        head_dim = x.shape[-1]
        self.check_dim(head_dim)
        g = x.float().reshape(*x.shape[:-1], head_dim // self.group, self.group)
        scale = (g.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
        s = scale.float()
        codes = torch.where(s > 0, g / s, 0.0).round_().clamp_(-127, 127).to(torch.int8)
        rows = torch.cat([codes.view(torch.uint8).flatten(-2),
                          scale.view(torch.uint8).flatten(-2)], dim=-1)  # fmt: skip
        return rows

    def stored_queries(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Queries ``[T, heads, head_dim]`` of ``layer`` in the order its keys are stored in
        (what a kernel reading the rows as stored takes)."""
        return q if self.key_order is None else self.key_order.queries(q, layer)

    def round_queries(self, q: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Queries ``[..., head_dim]`` as attention over this format scores them: for int8, each
        group of channels rounded to int8 codes times a float32 scale (max|q| / 127), so the
        native kernels take the dot products in integers (``csrc/flash_i8.cpp``) and the
        PyTorch path computes the same scores; float formats: ``q`` itself. With a key order,
        ``q`` is ``[T, heads, head_dim]`` of ``layer`` and its groups are those of the stored
        order (the kernels' groups), the result back in the model's order."""
        if not self.quantized:
            return q
        if self.key_order is not None:
            if layer is None:
                raise ValueError("queries against int8 keys with a key order need their layer")
            rounded = self.with_key_order(None).round_queries(self.key_order.queries(q, layer))
            return self.key_order.queries_to_model(rounded, layer)
        g = q.float().reshape(*q.shape[:-1], q.shape[-1] // self.group, self.group)
        s = g.abs().amax(-1, keepdim=True) / 127
        codes = torch.where(s > 0, g / s, 0.0).round_().clamp_(-127, 127)
        return (codes * s).flatten(-2).to(q.dtype)

    def decode(self, rows: torch.Tensor, head_dim: int, dtype: torch.dtype,
               keys_of: Layers | None = None) -> torch.Tensor:  # fmt: skip
        """Stored ``[..., row_width]`` back to values ``[..., head_dim]`` of ``dtype``, in the
        model's channel order (``keys_of``: as ``encode``'s)."""
        if not self.quantized:
            return rows.to(dtype)
        n = head_dim // self.group
        codes = rows[..., :head_dim].view(torch.int8).float()
        scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
        values = codes.view(*codes.shape[:-1], n, self.group) * scale[..., None]
        values = values.flatten(-2)
        if keys_of is not None and self.key_order is not None:
            values = self.key_order.to_model(values, keys_of)
        return values.to(dtype)
