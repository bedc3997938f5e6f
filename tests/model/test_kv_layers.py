"""``kv_float_layers auto``: the layers whose key bias is over ``AUTO_RATIO`` times the median
layer's, read from the weights at load (a Qwen2-architecture model, one layer's key bias made
large as in Qwen2.5's first layers); a model without key biases keeps every layer int8."""

from __future__ import annotations

import pytest
import torch

from radixserve.model import load_model
from radixserve.model.kv_layers import float_kv_layers, key_bias_rms
from testing.tiny_model import save_tiny_hf_model


def test_auto_picks_the_layer_with_a_large_key_bias(tmp_path, tiny_loaded):
    hf = save_tiny_hf_model(tmp_path / "a", "Qwen2Config", seed=3, num_hidden_layers=4)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.self_attn.k_proj.bias.normal_(0, 1.0)
            if i == 2:
                layer.self_attn.k_proj.bias[:4] += 150.0
    hf.save_pretrained(tmp_path / "b")
    model = load_model(str(tmp_path / "b"), dtype="float32", progress=False).model
    rms = key_bias_rms(model)
    assert rms[2] > 10 * max(rms[0], rms[1], rms[3])
    assert float_kv_layers(model, "auto") == (2,)
    assert float_kv_layers(model, "none") == ()
    assert float_kv_layers(model, "3,0,3") == (0, 3)
    with pytest.raises(ValueError, match="kv_float_layers '4'"):
        float_kv_layers(model, "4")
    assert float_kv_layers(tiny_loaded.model, "auto") == ()  # Llama: no key biases
