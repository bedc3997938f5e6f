"""Gemma 3 (text): the Llama-family layer with Gemma's differences, following transformers'
``Gemma3ForCausalLM``.

- Embeddings scaled by ``sqrt(hidden)``; the LM head is the (tied) embedding.
- RMSNorm multiplies by ``1 + weight`` (weights arrive in Hugging Face's convention; a GGUF
  file stores ``1 + weight``, which ``gguf_loader.py`` converts back); q and k are normed
  per head before RoPE.
- A layer is ``h += norm(attn(norm(h)))`` then ``h += norm(mlp(norm(h)))``: norms before and
  after attention and the MLP.
- The MLP is GeGLU: ``gelu_tanh(gate) * up``.
- The head size is its own (256 in the released models), attention scores are scaled by
  ``query_pre_attn_scalar ** -0.5``, and the local layers (five of every six) attend over a
  sliding window with their own RoPE base (``ModelConfig.window``, ``window.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from radixserve.model.attention import paged_attention
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaModel, RopeAt, Weight, rope_inv_freq
from radixserve.model.quant import linear

NORMS = ("input_norm", "post_norm", "pre_ffn_norm", "post_ffn_norm", "q_norm", "k_norm")


class Gemma3Model(LlamaModel):
    mlp_norm = "pre_ffn_norm"

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if not config.tie_word_embeddings:
            raise ValueError("Gemma 3 ties its LM head to the embedding")
        super().__init__(config, weights, device, dtype)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for key, name in (("pre_ffn_norm", "pre_feedforward_layernorm"),
                              ("post_ffn_norm", "post_feedforward_layernorm")):  # fmt: skip
                if p + name + ".weight" not in weights:
                    raise ValueError(f"model weights lack {p + name}.weight; is this Gemma 3?")
                layer[key] = weights[p + name + ".weight"].to(self.device, dtype)
            for key in NORMS:  # Gemma's RMSNorm scales by 1 + weight
                layer[key] = (layer[key].float() + 1).to(dtype)
        self.norm = (self.norm.float() + 1).to(dtype)
        self.local_rope = self._rope_tables(rope_inv_freq(config, None, local=True))
        self.embed_scale = config.hidden_size**0.5  # applied in float32, as llama.cpp does

    def _layer_ropes(self, positions: torch.Tensor) -> tuple[RopeAt, RopeAt]:
        return self._rope(positions), self._rope(positions, self.local_rope)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (super()._embed(input_ids).float() * self.embed_scale).to(self.dtype)

    def native_extras(self) -> dict[str, Any]:
        keys = ("post_norm", "post_ffn_norm")
        return super().native_extras() | {
            "out_norms": [layer[k] for layer in self.layers for k in keys],
            "local_cos": self.local_rope[0].float().contiguous(),
            "local_sin": self.local_rope[1].float().contiguous(),
            "embed_scale": self.embed_scale,
            "gelu": True,
        }

    def _mlp_input(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def _layer(self, i: int, h: torch.Tensor, rope, batch: ForwardBatch, pool,
               qkv: tuple | None = None):  # fmt: skip
        """``rope``: (global, local) as ``forward`` makes them, or one ``RopeAt`` for both."""
        layer = self.layers[i]
        if not isinstance(rope, RopeAt):
            rope = rope[self.windows[i] is not None]
        q, k, v = qkv if qkv is not None else self._qkv(layer, h, rope)
        attn = paged_attention(i, q, k, v, batch, pool, self.scale, self.windows[i])
        attn = linear(attn.reshape(h.shape[0], -1), layer["o"])
        h = h + self._rms_norm(attn, layer["post_norm"])
        x = self._rms_norm(h, layer["pre_ffn_norm"])
        mlp = linear(self._mlp_input(linear(x, layer["gate_up"])), layer["down"])
        return h + self._rms_norm(mlp, layer["post_ffn_norm"])
