"""Decode steps in one native call: ``csrc/decoder.cpp`` runs the whole layer stack.

A step of decode tokens only (no prompt chunk) on CPU goes here when the native kernels are
built and the model fits them: weights block-quantized (any ``quant.py`` format, stacks
included) or dense float32, head dim a multiple of 16 up to 256, inputs of every matrix a
multiple of 32. Llama-family layers and Qwen3's and Gemma 3's (their parts beyond a Llama
layer come from the model's ``native_extras``: q/k norms, output norms, GeGLU, windows).
Anything else (CUDA, bf16 dense weights, no compiler) returns None from ``for_model`` and the
step runs op by op in ``llama.py``, which computes the same function. The native stack keeps
float32 activations whatever the model dtype; the KV pool keeps its own format (its dtype, or
int8 rows: ``cache/kv_format.py``; an int8 pool's float layers in a pool of their own; an
int8 key order applied to each row's q and k before they meet the pool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixserve.model import native
from radixserve.model.quant import QuantizedWeight

if TYPE_CHECKING:
    from radixserve.cache.kv_pool import KVPool
    from radixserve.model.forward_batch import ForwardBatch


# a ``LlamaModel``: llama.py imports this module, so the type is not imported back
LlamaModel = Any


class NativeDecoder:
    def __init__(self, model: LlamaModel, ops: Any):
        c = model.config
        self.ops = ops
        layers = model.layers

        def view(w: torch.Tensor | QuantizedWeight) -> Any:
            if isinstance(w, QuantizedWeight):
                return w.native_view()
            n, k = w.shape
            return ops.QWeight(0, n, k, w.float().contiguous(), None, None)

        norms = [_f32(layer[key]) for layer in layers for key in ("input_norm", model.mlp_norm)]
        norms.append(_f32(model.norm))
        extras = {k: [_f32(t) for t in v] if k.endswith("norms") else v
                  for k, v in model.native_extras().items()}  # fmt: skip
        biases = [None if layer["qkv_bias"] is None else _f32(layer["qkv_bias"])
                  for layer in layers]  # fmt: skip
        cos, sin = (_f32(t) for t in model.rope_tables_float32())
        self.decoder = ops.Decoder(
            c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
            [view(layer["qkv"]) for layer in layers], [view(layer["o"]) for layer in layers],
            [view(layer["gate_up"]) for layer in layers], [view(layer["down"]) for layer in layers],
            norms, biases, view(model.embed), view(model.lm_head), cos, sin, model.scale,
            **extras,
        )  # fmt: skip

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """float32 logits ``[num_decode, vocab]`` of a step of decode tokens only."""
        window = {}
        if pool.windowed:  # the window layers' KV lives in a pool of its own
            window = {
                "w_out_slots": pool.to_window(batch.out_slots),
                "w_ctx": pool.to_window(batch.decode_context),
                "w_k_pool": pool.wk,
                "w_v_pool": pool.wv,
            }
        if pool.has_float_layers:  # an int8 pool keeping some layers in the model's dtype
            window = {
                "f_k_pool": pool.fk,
                "f_v_pool": pool.fv,
                "f_layers": pool.float_layers,
                "f_kv_code": pool.float_format.kernel_code,
            }
        fmt = pool.format
        key = {}
        if fmt.key_order is not None:
            key = {"key_order": fmt.key_order.perm, "key_scale": fmt.key_order.scale}
        return self.decoder.forward(
            batch.input_ids, batch.positions, batch.out_slots,
            batch.decode_context, batch.decode_lens, pool.k, pool.v, fmt.kernel_code, fmt.group,
            sequences=batch.decode_sequences, **key, **window,
        )  # fmt: skip


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def supported(model: LlamaModel) -> bool:
    c = model.config
    if model.device.type != "cpu" or c.head_dim % 16 or c.head_dim > 256 or c.hidden_size % 32:
        return False
    matrices = [model.embed, model.lm_head]
    for layer in model.layers:
        matrices += [layer["qkv"], layer["o"], layer["gate_up"], layer["down"]]
    for w in matrices:
        if isinstance(w, QuantizedWeight):
            continue
        if w.dtype != torch.float32 or w.shape[1] % 32:
            return False
    return True


def for_model(model: LlamaModel) -> NativeDecoder | None:
    """The model's native decoder (made on first use), or None where it cannot run."""
    ops = native.paged_ops() if model.device.type == "cpu" else None
    if ops is None:
        return None
    if model._native is None or model._native[0] is not ops:  # first use, or kernels swapped
        model._native = (ops, NativeDecoder(model, ops) if supported(model) else None)
    return model._native[1]
