"""How an int8 KV cache stores a model's keys: which layers keep their KV in the model's dtype
(``kv_float_layers``), and the order of the keys' channels (``key_order``).

Qwen2 and Qwen2.5 add large biases to the keys of a few layers (Qwen2.5-Coder-0.5B: key bias
RMS 35, 20, 13 and 25 in layers 0, 1, 2 and 8, about 1 elsewhere): every key of such a layer
carries channels near 100-200 beside channels near 1, and int8 with one scale per 16
channels rounds the small ones coarsely; attention there is also sharp, so the rounding moves
the attention weights far more than in other layers (measured per layer in
docs/caching.md). ``auto`` keeps a layer in float when the RMS of its key bias is more than
``AUTO_RATIO`` times the median layer's: known at load from the weights, the same on every
instance of a model (the transfer wire and stored pages carry int8 for every layer, so peers
need not agree anyway). Models without key biases keep every layer int8.

``key_order``: in those layers, the int8 rows store the key channels sorted by the size of
their rotary pair's key bias and divided by a power of two bringing it near the median pair's
(``KeyOrder``), so the channels near 100 no longer set the scales of the channels near 1;
from the weights, so equal on every instance of a model. Models without key biases: None
(keys as computed).
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.cache.kv_format import KeyOrder

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


def key_order(model: Any) -> KeyOrder | None:
    """The key channels' order of ``model``'s int8 KV: in the layers whose key bias is large
    (``auto``'s rule), per KV head, rotary pairs by the size of their key bias, largest first,
    each divided by the power of two that brings its bias near the median pair's; the other
    layers as computed (there the bias does not set the keys' sizes, and sorting by it loses
    accuracy: docs/benchmarks.md); None when no layer has such a bias."""
    c = model.config
    q_size, kv_size, half = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim // 2
    large = _large_bias_layers(key_bias_rms(model))
    if not large:
        return None
    perm = torch.arange(c.head_dim).repeat(len(model.layers), c.num_kv_heads, 1)
    scale = torch.ones(perm.shape)
    for i in large:
        bias = model.layers[i]["qkv_bias"][q_size : q_size + kv_size].float().cpu()
        keys = bias.view(c.num_kv_heads, c.head_dim)
        size = keys[:, :half].hypot(keys[:, half:])
        perm[i], scale[i] = KeyOrder.by_pair_size(size), KeyOrder.pair_scales(size)
    return KeyOrder(perm, scale)


def _large_bias_layers(rms: list[float]) -> tuple[int, ...]:
    """The layers whose key-bias RMS is over ``AUTO_RATIO`` times the median layer's."""
    median = float(torch.tensor(rms).median())
    if median <= 0:
        return ()
    return tuple(i for i, r in enumerate(rms) if r > AUTO_RATIO * median)


def float_kv_layers(model: Any, spec: str) -> tuple[int, ...]:
    """The layers ``spec`` (``auto``, ``none``, ``"0,1,8"``) names for ``model``; a ValueError
    names ``kv_float_layers`` when an index is past the model's layers."""
    if spec == "none":
        return ()
    num_layers = len(model.layers)
    if spec == "auto":
        return _large_bias_layers(key_bias_rms(model))
    layers = tuple(sorted({int(p) for p in spec.split(",")}))
    if layers and layers[-1] >= num_layers:
        raise ValueError(f"kv_float_layers {spec!r}: the model has layers 0..{num_layers - 1}")
    if layers and model.kv_shape().window_layers:
        raise ValueError(f"kv_float_layers {spec!r}: not supported for a model with "
                         "sliding-window layers")  # fmt: skip
    return layers
