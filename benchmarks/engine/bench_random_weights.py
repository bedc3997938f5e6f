"""Forward-pass speed of the default architecture with random weights, on any device.

For machines the default model's file cannot reach (a GPU box with no network): the model is
SmolLM2-135M's architecture (30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49152,
tied embeddings) with weights drawn on the device, so no file or tokenizer is needed. The
forward pass is driven directly (no scheduler, no sampling beyond argmax):

- prefill: one ``--prefill``-token chunk, logits of its last position; median of ``--repeat``.
- decode: for each batch size in ``--batches``, that many sequences of 128 prompt tokens are
  prefilled, then ``--steps`` decode steps of the whole batch are timed (greedy).

``--quantization int8`` / ``int4`` quantizes the random weights (q8_0 / q4_1) as the engine
would. ``--cuda-graphs``: each batch size's decode step is captured once in a CUDA graph and
replayed (its inputs copied into the captured tensors, the context padded to the last step's
length, so one graph serves every step); the greedy tokens are checked against the eager
steps'. On CPU the same padded static step runs without capture (a check of the padding).
Prints one JSON line. Usage:
``python -m benchmarks.engine.bench_random_weights --device cuda [--dtype bfloat16]
[--cuda-graphs]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from radixserve.cache import KVPool
from radixserve.model import LlamaModel, ModelConfig, build_forward_batch
from radixserve.model.forward_batch import ForwardBatch
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


def pad_decode(batch: ForwardBatch, length: int, pad_slot: int) -> ForwardBatch:
    """A decode batch whose context table is padded to ``length`` (pad slots masked)."""
    extra = length - batch.decode_context.shape[1]
    batch.decode_context = F.pad(batch.decode_context, (0, extra), value=pad_slot)
    batch.decode_bias = F.pad(batch.decode_bias, (0, extra), value=float("-inf"))
    return batch


class StaticStep:
    """One decode step's tensors at fixed shapes, run eagerly or replayed from a CUDA graph."""

    FIELDS = ("input_ids", "positions", "out_slots", "decode_context", "decode_bias",
              "decode_lens")  # fmt: skip

    def __init__(self, model: LlamaModel, pool: KVPool, first: ForwardBatch, capture: bool):
        self.model, self.pool, self.batch = model, pool, first
        self.graph = None
        if capture:  # warm up on a side stream (lazy allocations), then capture
            stream = torch.cuda.Stream(model.device)
            stream.wait_stream(torch.cuda.current_stream(model.device))
            with torch.cuda.stream(stream):
                model.forward(first, pool)
            torch.cuda.current_stream(model.device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = model.forward(first, pool)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        for name in self.FIELDS:
            getattr(self.batch, name).copy_(getattr(batch, name))
        if self.graph is None:
            return self.model.forward(self.batch, self.pool)
        self.graph.replay()
        return self.logits


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
    parser.add_argument("--cuda-graphs", action="store_true", help="replay decode steps")
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
        first = logits.argmax(-1).tolist()

        def decode_steps(static: StaticStep | None, first=first, slots=slots):
            tokens, times, out = first, [], []
            for step in range(args.steps):
                n = 128 + step
                decode = [(t, n, s[: n + 1]) for t, s in zip(tokens, slots, strict=True)]
                batch = build_forward_batch(decode, [], device, pool.pad_slot)
                if static is not None:
                    batch = pad_decode(batch, 128 + args.steps, pool.pad_slot)
                sync(device)
                t0 = time.perf_counter()
                logits = model.forward(batch, pool) if static is None else static.run(batch)
                tokens = logits.argmax(-1).tolist()
                sync(device)
                times.append(time.perf_counter() - t0)
                out += tokens
            return statistics.median(times[2:] or times), out

        step_s, eager_tokens = decode_steps(None)
        row = {"batch": b, "step_ms": round(step_s * 1e3, 3), "tokens_per_s": round(b / step_s, 1)}
        if args.cuda_graphs:
            decode = [(t, 128, s[:129]) for t, s in zip(first, slots, strict=True)]
            batch = pad_decode(build_forward_batch(decode, [], device, pool.pad_slot),
                               128 + args.steps, pool.pad_slot)  # fmt: skip
            step_s, graph_tokens = decode_steps(
                StaticStep(model, pool, batch, capture=device.type == "cuda")
            )
            row |= {"graph_step_ms": round(step_s * 1e3, 3),
                    "graph_tokens_per_s": round(b / step_s, 1),
                    "graph_tokens_equal_eager": graph_tokens == eager_tokens}  # fmt: skip
        results.append(row)
    print(json.dumps({
        "bench": "random_weights",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "cuda_graphs": args.cuda_graphs,
        "threads": torch.get_num_threads(),
        "prefill": {"tokens": args.prefill, "tokens_per_s": round(args.prefill / t_prefill, 1)},
        "decode": results,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
