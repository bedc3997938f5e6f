"""One decode step at a long context, and where its time goes: the whole step, the
attention alone, and the threads' use of it.

Method. Loads a model (default: Qwen2.5-Coder-0.5B Q4_K_M, weights kept quantized) and, for
each KV format in ``--variants`` (``float``: the model's dtype; ``int8/SPEC``: int8 KV with
``--kv-float-layers SPEC``) and each context length L in ``--lengths``, fills a pool of L
slots with K/V of the model's scale (random normal rows, written through the pool, so int8
rows are encoded as the engine encodes them; attention reads every key whatever the values,
so its cost does not depend on them). Then, best of ``--repeat`` each, with wall and process
CPU time:

- ``step``: one decode step of one sequence at position L - 1 over the whole context, as the
  engine runs it (``build_forward_batch`` and the native decoder: every layer, the LM head);
- ``attention``: the native attention of one query row over the L keys, summed over the
  model's layers (each layer's own pool and format), called directly;
- ``batch``: ``build_forward_batch`` alone (the per-step Python work that grows with L).

``step_short`` is the same step at a context of 16 tokens: ``step - step_short`` is what the
context costs. ``cpu_per_wall`` of the attention says how many threads it keeps busy. The
attention's ``gb_per_s``: the KV bytes it reads per step over its wall time. Threads:
``--threads`` (torch's intra-op threads). Prints one JSON line.

Usage: ``python -m benchmarks.engine.bench_decode_context --lengths 8192 16384 32768``
(``RADIXSERVE_NATIVE_ISA=avx2`` for the AVX2-only build).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from radixserve.cache.kv_format import KVFormat
from radixserve.cache.kv_pool import KVPool
from radixserve.model import build_forward_batch, load_model, native
from radixserve.model.kv_layers import float_kv_layers


def best(fn, repeat: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) of the fastest of ``repeat`` calls, after one warm-up."""
    fn()
    runs = []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        runs.append(((time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3))
    return min(runs)


def filled_pool(model, variant: str, length: int) -> KVPool:
    shape = model.kv_shape()
    if variant != "float":
        layers = float_kv_layers(model, variant.removeprefix("int8/"))
        shape = shape.with_format(KVFormat.of("int8"), layers)
    pool = KVPool(shape, length)
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(length)
    for layer in range(shape.num_layers):
        k, v = (torch.randn(length, shape.num_kv_heads, shape.head_dim, generator=gen) * 3
                for _ in range(2))  # fmt: skip
        pool.write(layer, slots, k.to(shape.dtype), v.to(shape.dtype))
    return pool


def measure(model, ops, variant: str, length: int, repeat: int) -> dict:
    pool = filled_pool(model, variant, length)
    c = model.config

    def batch_at(n: int):
        return build_forward_batch([(100, n - 1, torch.arange(n))], [], model.device, pool.pad_slot)

    def step(n: int) -> None:
        model.forward(batch_at(n), pool)

    q = torch.randn(1, c.num_heads, c.head_dim)
    zero, hi = torch.zeros(1, dtype=torch.int64), torch.tensor([length])
    seq_start = torch.tensor([0, 1])
    ctx = torch.arange(length)

    def attention() -> None:
        for layer in range(c.num_layers):
            k, v = pool.layer_kv(layer)
            fmt = pool.layer_format(layer)
            ops.flash_attention(q, k, v, fmt.kernel_code, fmt.group, ctx, zero, seq_start, zero,
                                hi, model.scale)  # fmt: skip

    kv_bytes = sum(2 * c.num_kv_heads * pool.layer_format(i).row_bytes(c.head_dim) * length
                   for i in range(c.num_layers))  # fmt: skip
    with torch.inference_mode():
        step_ms, step_cpu = best(lambda: step(length), repeat)
        short_ms, _ = best(lambda: step(16), repeat)
        attn_ms, attn_cpu = best(attention, repeat)
        batch_ms, _ = best(lambda: batch_at(length), repeat)
    return {
        "variant": variant, "length": length,
        "step_ms": round(step_ms, 2), "step_cpu_per_wall": round(step_cpu / step_ms, 2),
        "tokens_per_s": round(1e3 / step_ms, 2), "step_short_ms": round(short_ms, 2),
        "attention_ms": round(attn_ms, 2), "attention_cpu_per_wall": round(attn_cpu / attn_ms, 2),
        "attention_gb_per_s": round(kv_bytes / attn_ms / 1e6, 2), "batch_ms": round(batch_ms, 3),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--variants", nargs="+", default=["float", "int8/auto"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.paged_ops()
    if ops is None:
        parser.error("the native kernels are not built (RADIXSERVE_NATIVE=0 or no compiler)")
    model = load_model(args.model, progress=False).model
    rows = [measure(model, ops, v, n, args.repeat) for v in args.variants for n in args.lengths]
    isa = os.environ.get("RADIXSERVE_NATIVE_ISA", "native")
    print(json.dumps({"benchmark": "decode_context", "model": args.model, "threads": args.threads,
                      "isa": isa, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
