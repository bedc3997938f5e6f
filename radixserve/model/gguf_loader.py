"""Read a Llama-family GGUF file: its config, and its weights under HF names.

llama.cpp's converter permutes the rows of the Q and K projections of ``llama`` models for its
own rotary layout (pairs of adjacent dimensions instead of halves); ``unpermute_qk`` undoes
it so the weights follow the Hugging Face convention our forward pass uses. ``qwen2`` files
, ``qwen3`` and ``gemma3`` files are not permuted. Gemma's RMSNorm weights are stored as
``1 + weight`` (llama.cpp's converter adds the one); they load as Hugging Face's ``weight``.
A ``gemma3`` file does not say which layers are local nor their RoPE base: llama.cpp's
fixed values apply (every sixth layer global, base 10000, scores scaled by the head size).
Any tensor type ``gguf`` can dequantize loads (F32, F16, BF16, Q4_0, Q4_1,
Q5_x, Q8_0, K-quants). What stays quantized follows ``quantization`` (see ``quant.py``):
under ``auto`` every quantized matrix becomes a ``QuantizedWeight`` straight from its blocks
(Q5_0/Q5_1/K-quants as views of the memory-mapped file, nothing converted), the rest become
``dtype`` tensors (or are quantized, for ``int8`` / ``int4``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from radixserve.model.config import GEMMA3_PATTERN, ModelConfig, RopeScaling
from radixserve.model.gguf_file import GGUFFile
from radixserve.model.quant import (
    GGUF_BLOCKS,
    GGUF_FORMATS,
    QuantizedWeight,
    from_gguf_blocks,
    quantize,
    target_format,
)

GGUF_ARCH_TO_HF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma's sandwich norms: its ``ffn_norm`` is the norm before the MLP, not after attention
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in names:
            return f"model.layers.{layer}.{names[rest]}"
    return None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's row permutation of a Q or K projection (weight or bias)."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader: Any, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCH_TO_HF:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; radixserve runs {', '.join(GGUF_ARCH_TO_HF)}"
        )
    a = arch
    hidden = _field(reader, f"{a}.embedding_length")
    num_heads = _field(reader, f"{a}.attention.head_count")
    vocab = _field(reader, f"{a}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if _field(reader, f"{a}.rope.scaling.type") in ("linear",):
        scaling = RopeScaling("linear", factor=float(_field(reader, f"{a}.rope.scaling.factor")))
    eos = [_field(reader, "tokenizer.ggml.eos_token_id")]
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos:
        eos.append(eot)
    tensor_names = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=GGUF_ARCH_TO_HF[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{a}.feed_forward_length"),
        num_layers=_field(reader, f"{a}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_field(reader, f"{a}.attention.head_count_kv", num_heads),
        head_dim=_field(reader, f"{a}.attention.key_length", hidden // num_heads),
        max_position_embeddings=_field(reader, f"{a}.context_length", 4096),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(e) for e in eos if e is not None],
        name=name,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        **(_gemma3_fields(reader, hidden, num_heads) if arch == "gemma3" else {}),
    )


def _gemma3_fields(reader: Any, hidden: int, num_heads: int) -> dict[str, Any]:
    """Gemma 3's local layers and attention scale, as llama.cpp reads them."""
    layers = _field(reader, "gemma3.block_count")
    pattern = _field(reader, "gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: true where local
        local = tuple(i for i, is_local in enumerate(pattern) if is_local)
    else:
        local = tuple(i for i in range(layers) if (i + 1) % GEMMA3_PATTERN)
    head_dim = _field(reader, "gemma3.attention.key_length", hidden // num_heads)
    return {
        "sliding_window": int(_field(reader, "gemma3.attention.sliding_window", 0)),
        "sliding_layers": local,
        "rope_local_theta": float(_field(reader, "gemma3.rope.freq_base_swa", 10000.0)),
        # the 27B model (62 layers) scales by hidden / heads, the others by the head size
        "query_pre_attn_scalar": hidden / num_heads if layers == 62 else head_dim,
    }


def load_gguf(
    source: str | Path | GGUFFile,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    quantization: str = "auto",
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    """A GGUF file's config and weights; ``source`` a path or the file already opened."""
    import gguf

    reader = source if isinstance(source, GGUFFile) else GGUFFile(source)
    path = reader.path
    config = read_config(reader, name=path.stem)
    arch = _field(reader, "general.architecture")
    permute = arch == "llama"
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in tqdm(reader.tensors, desc=f"loading {path.name}", disable=not progress):
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        heads = None
        if permute and ".q_proj." in name:
            heads = config.num_heads
        elif permute and ".k_proj." in name:
            heads = config.num_kv_heads
        shape = tuple(int(x) for x in reversed(tensor.shape))
        kept = tensor.tensor_type.name
        fmt = target_format(name, shape, quantization, source=kept)
        if fmt is not None and fmt == GGUF_FORMATS.get(kept):
            weight = from_gguf_blocks(tensor.data, kept, shape)
            if heads is not None:
                perm = unpermute_qk(np.arange(shape[0]), heads)
                weight = weight.rows(torch.from_numpy(perm))
            weights[name] = weight
            if weight.fmt in GGUF_BLOCKS and heads is None:
                continue  # a view of the map: its pages are the weight
            reader.release(tensor)  # copied: its pages of the map need not stay resident
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        if heads is not None:
            array = unpermute_qk(array, heads)
        dense = torch.from_numpy(array.copy())
        reader.release(tensor)
        if fmt is not None:
            weights[name] = quantize(dense, fmt)
        else:
            keep_fp32 = name == "rope_freq_factors"
            if arch == "gemma3" and name.endswith("norm.weight"):
                dense = dense - 1  # stored as 1 + weight
            weights[name] = dense.to(torch.float32 if keep_fp32 else dtype)
    return config, weights
