"""Which layers of an int8 KV cache keep their KV in the model's dtype (``kv_float_layers``).

Qwen2 and Qwen2.5 add large biases to the keys of a few layers (Qwen2.5-Coder-0.5B: key bias
RMS 35, 20, 13 and 25 in layers 0, 1, 2 and 8, about 1 elsewhere): every key of such a layer
carries channels near 100-200 beside channels near 1, and int8 with one scale per 16
channels rounds the small ones coarsely; attention there is also sharp, so the rounding moves
the attention weights far more than in other layers (measured per layer in
docs/caching.md). ``auto`` keeps a layer in float when the RMS of its key bias is more than
``AUTO_RATIO`` times the median layer's: known at load from the weights, the same on every
instance of a model (the transfer wire and stored pages carry int8 for every layer, so peers
need not agree anyway). Models without key biases keep every layer int8.
"""

from __future__ import annotations

from typing import Any

import torch

AUTO_RATIO = 10.0


def key_bias_rms(model: Any) -> list[float]:
    """Per layer, the RMS of the key projection's bias (0 where it has none)."""
    c = model.config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = []
    for layer in model.layers:
        bias = layer.get("qkv_bias")
        if bias is None:
            out.append(0.0)
            continue
        out.append(float(bias[q_size : q_size + kv_size].float().pow(2).mean().sqrt()))
    return out


def float_kv_layers(model: Any, spec: str) -> tuple[int, ...]:
    """The layers ``spec`` (``auto``, ``none``, ``"0,1,8"``) names for ``model``; a ValueError
    names ``kv_float_layers`` when an index is past the model's layers."""
    if spec == "none":
        return ()
    num_layers = len(model.layers)
    if spec == "auto":
        rms = key_bias_rms(model)
        median = float(torch.tensor(rms).median())
        if median <= 0:
            return ()
        return tuple(i for i, r in enumerate(rms) if r > AUTO_RATIO * median)
    layers = tuple(sorted({int(p) for p in spec.split(",")}))
    if layers and layers[-1] >= num_layers:
        raise ValueError(f"kv_float_layers {spec!r}: the model has layers 0..{num_layers - 1}")
    if layers and model.kv_shape().window_layers:
        raise ValueError(f"kv_float_layers {spec!r}: not supported for a model with "
                         "sliding-window layers")  # fmt: skip
    return layers
