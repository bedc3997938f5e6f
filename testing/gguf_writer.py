"""Test helper: write a transformers Llama, Qwen2, Qwen3 or Gemma 3 (text) model to GGUF the
way llama.cpp's converter does.

Llama's Q and K projection rows are permuted into llama.cpp's rotary layout, so loading the file
exercises the un-permutation that real GGUF files need. ``types`` gives some tensors another
type than ``qtype`` (a Q4_K_M-like mix); the ``gguf`` package cannot quantize to K-quants,
so those tensors get random blocks with sane scales (``random_blocks``) instead of the
model's weights: the file is then its own model, for comparing its quantized and
dequantized loads. Gemma's norms are written as ``1 + weight``, as llama.cpp's converter
writes them, with its sandwich norms under their own names.
"""

from __future__ import annotations

import zlib

import gguf
import numpy as np

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# where each block format keeps its f16 scales (byte offsets in a block)
F16_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}  # fmt: skip
# magnitudes of those scales that give weights of roughly +-0.2
F16_SCALE = {"Q2_K": (0.01, 0.003), "Q3_K": (0.002,), "Q4_K": (0.0004, 0.002),
             "Q5_K": (0.0002, 0.002), "Q6_K": (0.0002,)}  # fmt: skip


def random_blocks(rows: int, cols: int, qtype: gguf.GGMLQuantizationType, rng) -> np.ndarray:
    """Random blocks of ``qtype`` for a ``[rows, cols]`` tensor (uint8 ``[rows, row bytes]``):
    random codes and scales, the f16 scales finite and of either sign."""
    inputs, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // inputs, size), dtype=np.uint8)
    scales = F16_SCALE.get(qtype.name, (0.01, 0.01))
    for offset, scale in zip(F16_FIELDS[qtype.name], scales, strict=False):
        value = (rng.normal(0, scale, (rows, cols // inputs)) + scale).astype(np.float16)
        blocks[..., offset : offset + 2] = value.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def write_llama_gguf(model, path, qtype: gguf.GGMLQuantizationType, types=None) -> None:
    """A ``llama``, ``qwen2``, ``qwen3`` or ``gemma3_text`` model (QKV biases, an untied head
    where the model has one; llama.cpp permutes only ``llama``'s Q and K rows)."""
    c = model.config
    arch = {"gemma3_text": "gemma3"}.get(c.model_type, c.model_type)
    layer_names = _GEMMA_LAYER if arch == "gemma3" else _LAYER
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not c.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(c.num_hidden_layers):
        for hf, cpp in layer_names.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{cpp}.weight"
            if hf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                names[f"model.layers.{i}.{hf}.bias"] = f"blk.{i}.{cpp}.bias"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    rope = c.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name not in names:
            continue  # a tied lm_head is the embedding
        w = tensor.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, c.num_key_value_heads)
        t = qtype if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        t = next((v for k, v in (types or {}).items() if k in names[name] and w.ndim == 2), t)
        if t.name in F16_SCALE:
            rng = np.random.default_rng(zlib.crc32(names[name].encode()))
            data = random_blocks(*w.shape, t, rng)
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(w), t)
        writer.add_tensor(names[name], data, raw_shape=data.shape, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
