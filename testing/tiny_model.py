"""A tiny random Llama-family model saved as an HF directory, for engine tests.

It uses the default model's vocabulary size (49152) so text round-trips through the default
tokenizer, with a small random network so engine tests run in seconds. Its weights are drawn
with a larger spread than usual so greedy choices are not near-ties.
"""

from __future__ import annotations

import torch

TINY_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def save_tiny_hf_model(path, config_cls_name: str = "LlamaConfig", seed: int = 0, **overrides):
    """Write a random model of the given transformers config class to ``path``."""
    import transformers

    cfg = getattr(transformers, config_cls_name)(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return model
