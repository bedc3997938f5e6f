"""Forward-pass speed of the default architecture with random weights, on any device.

For machines the default model's file cannot reach (a GPU box with no network): the model is
SmolLM2-135M's architecture (30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49152,
tied embeddings) with weights drawn on the device, so no file or tokenizer is needed. The
forward pass is driven directly (no scheduler, no sampling beyond argmax):

- prefill: one ``--prefill``-token chunk, logits of its last position; median of ``--repeat``.
- decode: for each batch size in ``--batches``, that many sequences of 128 prompt tokens are
  prefilled, then ``--steps`` decode steps of the whole batch are timed (greedy).

``--quantization int8`` / ``int4`` quantizes the random weights (q8_0 / q4_1) as the engine
would. Prints one JSON line. Usage:
``python benchmarks/bench_random_weights.py --device cuda [--dtype bfloat16]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from radixserve.cache import KVPool
from radixserve.model import LlamaModel, ModelConfig, build_forward_batch
from radixserve.model.loader import parse_dtype
from radixserve.model.quant import quantize_dense

SMOLLM2_135M = dict(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, name="random-smollm2-135m",
)  # fmt: skip


def random_weights(c: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size),
           "model.norm.weight": torch.ones(c.hidden_size)}  # fmt: skip
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": torch.ones(c.hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(c.hidden_size),
            p + "self_attn.q_proj.weight": w(q, c.hidden_size),
            p + "self_attn.k_proj.weight": w(kv, c.hidden_size),
            p + "self_attn.v_proj.weight": w(kv, c.hidden_size),
            p + "self_attn.o_proj.weight": w(c.hidden_size, q),
            p + "mlp.gate_proj.weight": w(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": w(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": w(c.hidden_size, c.intermediate_size),
        }
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype, args.device)
    config = ModelConfig(**SMOLLM2_135M)
    weights = quantize_dense(random_weights(config), args.quantization)
    model = LlamaModel(config, weights, device=device, dtype=dtype)
    batches = [int(b) for b in args.batches.split(",")]
    pool = KVPool(model.kv_shape(), max(args.prefill, max(batches) * (128 + args.steps)) + 1,
                  device)  # fmt: skip
    g = torch.Generator().manual_seed(1)

    def prefill_once() -> float:
        ids = torch.randint(100, 40000, (args.prefill,), generator=g)
        batch = build_forward_batch([], [(ids, 0, torch.arange(args.prefill), True)], device,
                                    pool.pad_slot)  # fmt: skip
        sync(device)
        t0 = time.perf_counter()
        model.forward(batch, pool)
        sync(device)
        return time.perf_counter() - t0

    prefill_once()  # warm-up
    t_prefill = statistics.median(prefill_once() for _ in range(args.repeat))
    results = []
    for b in batches:
        slots = [
            torch.arange(i * (128 + args.steps), (i + 1) * (128 + args.steps)) for i in range(b)
        ]
        prompts = [
            (torch.randint(100, 40000, (128,), generator=g), 0, s[:128], True) for s in slots
        ]
        logits = model.forward(build_forward_batch([], prompts, device, pool.pad_slot), pool)
        tokens = logits.argmax(-1).tolist()
        times = []
        for step in range(args.steps):
            n = 128 + step
            decode = [(t, n, s[: n + 1]) for t, s in zip(tokens, slots, strict=True)]
            batch = build_forward_batch(decode, [], device, pool.pad_slot)
            sync(device)
            t0 = time.perf_counter()
            tokens = model.forward(batch, pool).argmax(-1).tolist()
            sync(device)
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times[2:] or times)
        results.append({"batch": b, "step_ms": round(step_s * 1e3, 3),
                       "tokens_per_s": round(b / step_s, 1)})  # fmt: skip
    print(json.dumps({
        "bench": "random_weights",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "threads": torch.get_num_threads(),
        "prefill": {"tokens": args.prefill, "tokens_per_s": round(args.prefill / t_prefill, 1)},
        "decode": results,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
