"""ModelConfig: the shape of a model, read from HF config.json or GGUF metadata.

One dataclass covers Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3 and Gemma 3: the variants differ
in flags (``attention_bias`` for Qwen2's QKV bias, ``qk_norm`` for Qwen3's and Gemma 3's
per-head RMSNorm of q and k, ``rope_scaling`` for Llama 3.1+, tied embeddings) and, for
Gemma 3, in the fields of its local layers: ``sliding_window`` tokens of attention (a query
at position i sees keys i - W < j <= i) with their own RoPE base on the layers
``sliding_layers``, and the attention scale ``query_pre_attn_scalar ** -0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# Gemma 3: every sixth layer attends globally, the five before it over a sliding window
GEMMA3_PATTERN = 6


@dataclass
class RopeScaling:
    """Llama-3-style frequency scaling (``rope_type: llama3``); ``linear`` divides positions."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RopeScaling | None:
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ("llama3", "linear"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (llama3, linear)")
        return cls(
            rope_type=rope_type,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"
    qk_norm: bool = False
    sliding_window: int = 0  # tokens a local layer sees (0: no local layers)
    sliding_layers: tuple[int, ...] = ()  # the local layers
    rope_local_theta: float = 10000.0  # the RoPE base of the local layers
    query_pre_attn_scalar: float | None = None  # attention scale ** -2 (None: head_dim)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"radixserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} heads not divisible by {self.num_kv_heads} KV heads"
            )
        if self.sliding_layers and self.sliding_window <= 0:
            raise ValueError("local (sliding-window) layers need a positive sliding_window")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers} out of range")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        """The tokens layer ``layer`` attends over (None: all of them)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3":
            raise ValueError(
                "this is a multimodal Gemma 3 checkpoint; radixserve runs the text-only ones "
                "(model_type gemma3_text)"
            )
        model_type = {"gemma3_text": "gemma3"}.get(model_type, model_type)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        local = _local_layers(cfg, model_type)
        if model_type == "gemma3" and isinstance(rope, dict) and "full_attention" in rope:
            rope = rope["full_attention"]  # per layer type: the local layers' base is apart
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(rope, dict):
            theta = rope.get("rope_theta")
        eos = cfg.get("eos_token_id")
        max_pos = cfg.get("max_position_embeddings", 4096)
        if model_type == "mistral" and cfg.get("sliding_window"):
            # Attention over more than the window would differ from the model's training.
            max_pos = min(max_pos, cfg["sliding_window"])
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=RopeScaling.from_dict(rope),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            name=name,
            qk_norm=model_type in ("qwen3", "gemma3"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            **local,
        )


def _local_layers(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The sliding-window fields of an HF config (Gemma 3; Qwen3 only without a window)."""
    if model_type == "qwen3" and cfg.get("use_sliding_window"):
        raise ValueError("Qwen3 with use_sliding_window is not supported")
    if model_type != "gemma3":
        return {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"Gemma 3 with {key} is not supported")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", GEMMA3_PATTERN) == 0
        else "sliding_attention" for i in range(n)
    ]  # fmt: skip
    rope = cfg.get("rope_parameters") or {}
    local_rope = rope.get("sliding_attention") or {}
    theta = local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return {
        "sliding_window": int(cfg.get("sliding_window") or 0),
        "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        "rope_local_theta": float(theta),
    }
