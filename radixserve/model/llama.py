"""The Llama-family forward pass (Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3) over the paged KV
pool; Gemma 3 (``gemma3.py``) extends it.

Weights use Hugging Face names on input and are fused on load (Q/K/V into one projection,
gate/up into another) so a layer is four matmuls; a matrix is a dense tensor or a
``QuantizedWeight`` (``quant.py``). RMSNorm and RoPE follow transformers'
``LlamaForCausalLM`` exactly (rotate-half layout; Llama-3 and linear RoPE scaling; per-
frequency factors from GGUF ``rope_freqs``); Qwen3's q and k are RMS-normed per head before
RoPE (``qk_norm``). Layers with a sliding window attend over it only (``attention.py``).
``forward`` computes logits only at
``batch.logits_indices``: the last token of each sequence that samples, never every prompt
position. A step of decode tokens only runs in one native call where the kernels are built
(``native_decode.py``); everything else runs op by op here, with RMSNorm, RoPE and
SiLU(gate) * up in native row kernels on a float32 CPU model (``_row_kernels``) and the
residual adds inside the matmuls.

``forward_layers`` runs a batch layer by layer and shows each layer's fresh Q/K/V before the
layer writes them: what RAG segments compare with the K/V the pool holds (``engine/segments``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from radixserve.cache.kv_pool import KVPool, KVShape
from radixserve.model import native, native_decode
from radixserve.model.attention import paged_attention
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.kv_layers import key_order
from radixserve.model.quant import QuantizedWeight, linear

Weight = torch.Tensor | QuantizedWeight


def rope_inv_freq(
    config: ModelConfig, freq_factors: torch.Tensor | None, local: bool = False
) -> torch.Tensor:
    """The RoPE frequencies; ``local``: the local layers' (their own base, never scaled)."""
    dim = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = None if local else config.rope_scaling
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    elif s is not None and s.rope_type == "linear":
        inv_freq = inv_freq / s.factor
    elif s is not None and s.rope_type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq.to(torch.float32)


class RopeAt(NamedTuple):
    """RoPE for a batch's rows: their positions, and the gathered tables on the PyTorch path
    (None where the native row kernels rotate straight from the full tables ``tables``)."""

    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    tables: tuple[torch.Tensor, torch.Tensor] | None = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    mlp_norm = "post_norm"  # the layer's norm before its MLP

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.scale = config.attention_scale
        c = config

        def take(name: str) -> Weight:
            if name not in weights:
                raise ValueError(f"model weights lack {name!r}; is this a {c.architecture} model?")
            w = weights[name]
            if isinstance(w, QuantizedWeight):
                return w.to(self.device)
            return w.to(device=self.device, dtype=dtype)

        def fuse(parts: list[Weight]) -> Weight:
            if all(isinstance(p, QuantizedWeight) for p in parts):
                return QuantizedWeight.cat(parts)
            dense = [p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in parts]
            return torch.cat(dense)

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else take("lm_head.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer = {
                "input_norm": take(p + "input_layernorm.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                "qkv": fuse([take(a + f"{x}_proj.weight") for x in "qkv"]),
                "o": take(a + "o_proj.weight"),
                "gate_up": fuse([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                "down": take(p + "mlp.down_proj.weight"),
                "qkv_bias": None,
            }
            if c.attention_bias:
                layer["qkv_bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
            if c.qk_norm:
                layer["q_norm"] = take(a + "q_norm.weight")
                layer["k_norm"] = take(a + "k_norm.weight")
            self.layers.append(layer)
        inv_freq = rope_inv_freq(c, weights.get("rope_freq_factors"))
        self.rope_inv_freq = inv_freq.to(self.device)
        self.rope_cos, self.rope_sin = self._rope_tables(inv_freq)
        self.windows = [c.window(i) for i in range(c.num_layers)]
        self.key_order = key_order(self)  # how int8 KV stores the keys' channels
        # (kernels module, its decoder or None where the model does not fit it)
        self._native: tuple[Any, native_decode.NativeDecoder | None] | None = None
        # the native row kernels take float32 rows of these widths (RMSNorm, RoPE, SiLU * up)
        self._rows_fit = (
            self.device.type == "cpu" and dtype == torch.float32 and c.head_dim % 16 == 0
            and c.hidden_size % 8 == 0 and c.intermediate_size % 8 == 0
        )  # fmt: skip

    def _rope_tables(self, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        to = {"device": self.device, "dtype": self.dtype}
        return angles.cos().to(**to), angles.sin().to(**to)

    def rope_tables_float32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables as the native decoder wants them (same values as ours)."""
        return self.rope_cos.float(), self.rope_sin.float()

    def native_extras(self) -> dict[str, Any]:
        """The native decoder's arguments beyond a Llama layer's (``native_decode.py``)."""
        extras: dict[str, Any] = {"windows": [w or 0 for w in self.windows]}
        if self.config.qk_norm:
            extras["qk_norms"] = [layer[k] for layer in self.layers for k in ("q_norm", "k_norm")]
        return extras

    def kv_shape(self) -> KVShape:
        c = self.config
        return KVShape(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, c.sliding_layers,
                       key_order=self.key_order)  # fmt: skip

    def _row_kernels(self) -> Any | None:
        """The native row-wise kernels (RMSNorm, RoPE, SiLU * up) for a float32 CPU model,
        else None: the same functions op by op."""
        return native.paged_ops() if self._rows_fit else None

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ops = self._row_kernels()
        if ops is not None:
            return ops.rms_norm(x.contiguous(), weight, self.config.rms_norm_eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)
        return weight * normed.to(x.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run one packed step; return float32 logits ``[len(batch.logits_indices), vocab]``."""
        if batch.num_decode == batch.num_tokens:
            decoder = native_decode.for_model(self)
            if decoder is not None:
                return decoder.forward(batch, pool)
        h = self._embed(batch.input_ids)
        rope = self._layer_ropes(batch.positions)
        for i in range(len(self.layers)):
            h = self._layer(i, h, rope, batch, pool)
        return self._logits(h[batch.logits_indices])

    def _layer_ropes(self, positions: torch.Tensor) -> Any:
        """The RoPE of a batch's rows as ``_layer`` takes it (Gemma 3: one per kind of layer)."""
        return self._rope(positions)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final hidden rows ``h``. The final norm and a quantized LM
        head run in float32 whatever the model dtype: logits rounded to bfloat16 (steps of
        0.125 between 16 and 32) tie the best candidates, and greedy decoding then picks by
        token id. A dense LM head multiplies in the model's dtype (a float32 copy would
        double its memory)."""
        x = self._rms_norm(h.float(), self.norm)
        if isinstance(self.lm_head, QuantizedWeight):
            return self.lm_head.matmul(x)
        return F.linear(x.to(self.dtype), self.lm_head).float()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.embedding(input_ids, self.dtype)
        return F.embedding(input_ids, self.embed)

    def _rope(self, positions: torch.Tensor, tables: tuple | None = None) -> RopeAt:
        cos, sin = tables or (self.rope_cos, self.rope_sin)
        if self._row_kernels() is not None:
            return RopeAt(positions.contiguous(), None, None, (cos, sin))
        return RopeAt(positions, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))

    def _qkv(self, layer: dict, h: torch.Tensor, rope: RopeAt):
        c, t = self.config, h.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x = self._rms_norm(h, layer["input_norm"])
        qkv = linear(x, layer["qkv"], layer["qkv_bias"])
        if c.qk_norm:
            qkv = self._norm_qk(layer, qkv)
        if rope.cos is None:  # native: q and k heads rotated in place, in one pass
            heads = c.num_heads + c.num_kv_heads
            qkv = qkv.contiguous()
            self._row_kernels().rope_(qkv, rope.positions, *rope.tables, heads, c.head_dim)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, c.num_heads, c.head_dim)
        k = k.view(t, c.num_kv_heads, c.head_dim)
        if rope.cos is not None:
            q = q * rope.cos + rotate_half(q) * rope.sin
            k = k * rope.cos + rotate_half(k) * rope.sin
        return q, k, v.reshape(t, c.num_kv_heads, c.head_dim)

    def _norm_qk(self, layer: dict, qkv: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each q head and each k head over its own dimensions (Qwen3, Gemma 3)."""
        c, t = self.config, qkv.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self._rms_norm(q.reshape(-1, c.head_dim), layer["q_norm"]).view(t, q_size)
        k = self._rms_norm(k.reshape(-1, c.head_dim), layer["k_norm"]).view(t, kv_size)
        return torch.cat([q, k, v], dim=-1)

    def _mlp_input(self, gate_up: torch.Tensor) -> torch.Tensor:
        ops = self._row_kernels()
        if ops is not None:
            return ops.silu_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _layer(self, i: int, h: torch.Tensor, rope: RopeAt, batch: ForwardBatch, pool: KVPool,
               qkv: tuple | None = None):  # fmt: skip
        layer = self.layers[i]
        q, k, v = qkv if qkv is not None else self._qkv(layer, h, rope)
        attn = paged_attention(i, q, k, v, batch, pool, self.scale, self.windows[i])
        h = linear(attn.reshape(h.shape[0], -1), layer["o"], residual=h)
        x = self._rms_norm(h, layer["post_norm"])
        return linear(self._mlp_input(linear(x, layer["gate_up"])), layer["down"], residual=h)

    @torch.inference_mode()
    def forward_layers(
        self, batch: ForwardBatch, pool: KVPool, last: int
    ) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """The forward of ``batch`` layer by layer up to layer ``last``: yield each layer's
        index and its fresh ``(q, k, v)`` (after RoPE, ``[rows, heads, head_dim]``) before the
        layer runs; the layers before ``last`` then run whole (writing their K/V to the pool).
        For callers that look at a layer's K/V before it replaces the pool's (RAG segments)."""
        if not 0 <= last < len(self.layers):
            raise ValueError(f"the last layer must be in [0, {len(self.layers)}), got {last}")
        h = self._embed(batch.input_ids)
        rope = self._rope(batch.positions)
        for i in range(last + 1):
            qkv = self._qkv(self.layers[i], h, rope)
            yield i, qkv
            if i < last:
                h = self._layer(i, h, rope, batch, pool, qkv)
