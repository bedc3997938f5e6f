"""Engine benchmark on the default model (SmolLM2-135M-Instruct), side by side in one run.

1. Prefill of a 2K-token prompt: our forward (one chunk, logits of the last position only)
   vs transformers' ``model(input_ids)`` on the same GGUF weights (logits for every position,
   as a user calls it); also transformers with ``logits_to_keep=1`` for reference. Median of
   ``--repeat`` runs, tokens/s. Also our prefill in 256-token chunks (the CPU default), and
   the matmul roofline: the model's four matmul shapes at 2048 rows timed with
   ``torch.matmul`` in float32 and (on CPUs that compute it natively) bfloat16 on dense
   weights (median of ``--repeat``), the faster dtype's FLOP/s divided by 2 x the layers'
   parameters gives the tokens/s a prefill could reach if it were nothing but those matmuls;
   ``share_of_roofline`` is ours / that.
2. Decode throughput at batch 1, 8 and 32: each request a 128-token prompt, 64 greedy tokens
   (``ignore_eos``); tokens/s over the decode steps only (prefill excluded).
3. A 5-turn chat whose history reaches ~1.5K tokens: time to the first token of each turn,
   with the cache on (the model writes each 250-token answer, as in a real chat) and off
   (the same five prompts, the answers replayed). Reports turns 2 and 5 and the speed-ups.

Prints one JSON line. Usage: ``python -m benchmarks.engine.bench_engine [--repeat 3]
[--dtype float32] [--quantization auto] [--prefill-only]`` (the engine's ``--quantization``;
transformers always runs the dequantized weights; ``--prefill-only``: part 1 without transformers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.model import load_model
from radixserve.model.loader import cpu_has_fast_bf16
from radixserve.model.quant import QUANTIZATIONS


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def roofline(loaded, repeat: int, rows: int = 2048) -> dict:
    """tokens/s of a prefill that were only the layers' matmuls, at the best dense dtype."""
    c = loaded.model.config
    q_kv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    shapes = [
        (q_kv, c.hidden_size),
        (c.hidden_size, c.num_heads * c.head_dim),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    flops_per_token = 2 * c.num_layers * sum(n * k for n, k in shapes)
    out = {"flops_per_token": flops_per_token}
    # bfloat16 only where the CPU computes it natively: elsewhere it is emulated, far slower
    # than float32 (minutes per repeat), and can never be the roofline
    dtypes = (torch.float32, torch.bfloat16) if cpu_has_fast_bf16() else (torch.float32,)
    for dtype in dtypes:
        xs = [torch.randn(rows, k, dtype=dtype) for _, k in shapes]
        ws = [torch.randn(n, k, dtype=dtype) for n, k in shapes]

        def layer(xs=xs, ws=ws):
            for x, w in zip(xs, ws, strict=True):
                torch.matmul(x, w.T)

        t = median_time(layer, repeat)
        gflops = rows * flops_per_token / c.num_layers / t / 1e9
        out[f"{str(dtype).removeprefix('torch.')}_gflops"] = round(gflops, 1)
    best = max(v for k, v in out.items() if k.endswith("_gflops"))
    out["tokens_per_s"] = round(best * 1e9 / flops_per_token, 1)
    return out


def bench_prefill(loaded, reference, repeat: int, n: int = 2048) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 40000, n).tolist()

    def make_engine(chunk: int) -> Engine:
        config = EngineConfig.from_options(load_progress=False, chunked_prefill_size=chunk,
                              enable_prefix_caching=False, max_total_tokens=n + 64)  # fmt: skip
        return Engine(config, loaded)

    engine, chunked = make_engine(n), make_engine(256)

    def ours(engine=engine):
        engine.add_request("p", ids, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()

    x = torch.tensor([ids])

    def hf_full():
        with torch.inference_mode():
            reference(x)

    def hf_last():
        with torch.inference_mode():
            reference(x, logits_to_keep=1)

    t_ours = median_time(ours, repeat)
    t_chunked = median_time(lambda: ours(chunked), repeat)
    result = {
        "prompt_tokens": n,
        "ours_tokens_per_s": round(n / t_ours, 1),
        "ours_chunks_of_256_tokens_per_s": round(n / t_chunked, 1),
    }
    if reference is None:
        return result
    t_full, t_last = (median_time(f, repeat) for f in (hf_full, hf_last))
    return result | {
        "transformers_tokens_per_s": round(n / t_full, 1),
        "transformers_last_logits_tokens_per_s": round(n / t_last, 1),
        "speedup_vs_transformers": round(t_full / t_ours, 2),
        "speedup_vs_transformers_last_logits": round(t_last / t_ours, 2),
    }


def bench_decode(loaded, batch: int, prompt_len: int = 128, new_tokens: int = 64) -> dict:
    rng = np.random.default_rng(batch)
    engine = Engine(
        EngineConfig.from_options(
            load_progress=False,
            max_total_tokens=batch * 256 + 256,
            chunked_prefill_size=batch * prompt_len,
            max_running_requests=batch,
        ),
        loaded,
    )
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", rng.integers(100, 40000, prompt_len).tolist(), params)
    engine.step()  # the whole batch's prefill
    decoded, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        decoded += len(engine.step())
    elapsed = time.perf_counter() - t0
    return {"batch": batch, "tokens_per_s": round(decoded / elapsed, 1)}


def chat_ttft(llm: LLM, history: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """Time to first token of one chat turn, the answer's text, and the prompt length."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0, ttft, tracker = time.perf_counter(), None, None
    for _, tracker in llm.stream(history, params):
        if ttft is None and tracker.token_ids:
            ttft = time.perf_counter() - t0
    return ttft, tracker.text, tracker.usage.prompt_tokens


def bench_multiturn(loaded, answer_tokens: int = 250) -> dict:
    """A 5-turn chat whose history reaches ~1.5K tokens, cache on, the model writing each
    answer; then the same five prompts (those answers replayed) with the cache off."""

    def make_llm(caching: bool) -> LLM:
        config = EngineConfig.from_options(
            load_progress=False,
            max_total_tokens=16384,
            enable_prefix_caching=caching,
            chunked_prefill_size=4096,
        )
        return LLM.from_engine(Engine(config, loaded))

    system = (
        "You are a patient teacher of data structures. You explain radix trees, tries, "
        "hash maps and B-trees with concrete examples and short code sketches. " * 4
    )
    questions = [
        f"Question {i + 1}: explain how a radix tree handles the insertion of a key "
        f"that shares its first {i + 2} characters with an existing key, step by step."
        for i in range(5)
    ]
    on, history = make_llm(True), [{"role": "system", "content": system}]
    ttft_on, prompts = [], []
    for q in questions:
        history.append({"role": "user", "content": q})
        ttft, answer, prompt_len = chat_ttft(on, history, answer_tokens)
        ttft_on.append(ttft)
        prompts.append(prompt_len)
        history.append({"role": "assistant", "content": answer})
    off, ttft_off = make_llm(False), []
    for turn in range(5):
        ttft, _, prompt_len = chat_ttft(off, history[: 2 + 2 * turn], 1)
        assert prompt_len == prompts[turn]  # the very same prompts
        ttft_off.append(ttft)
    return {
        "prompt_tokens_per_turn": prompts,
        "ttft_cache_on_s": [round(t, 4) for t in ttft_on],
        "ttft_cache_off_s": [round(t, 4) for t in ttft_off],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    parser.add_argument(
        "--prefill-only", action="store_true", help="our prefill and the roofline only"
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    loaded = load_model(None, dtype=args.dtype, progress=False, quantization=args.quantization)
    path = loaded.path
    reference = None
    if not args.prefill_only:
        reference = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=getattr(torch, args.dtype)
        ).eval()
    result = {
        "bench": "engine",
        "dtype": args.dtype,
        "quantization": args.quantization,
        "threads": torch.get_num_threads(),
        "prefill": bench_prefill(loaded, reference, args.repeat),
        "roofline": roofline(loaded, args.repeat),
    }
    ours = result["prefill"]["ours_tokens_per_s"]
    result["prefill"]["share_of_roofline"] = round(ours / result["roofline"]["tokens_per_s"], 3)
    if args.prefill_only:
        print(json.dumps(result))
        return
    del reference
    decode = [bench_decode(loaded, b) for b in (1, 8, 16, 32)]
    result["decode"] = decode
    result["decode_batch32_vs_batch1"] = round(
        decode[-1]["tokens_per_s"] / decode[0]["tokens_per_s"], 2
    )
    turns = bench_multiturn(loaded)
    on, off = turns["ttft_cache_on_s"], turns["ttft_cache_off_s"]
    result["multiturn"] = {
        **turns,
        "turn2_speedup": round(off[1] / on[1], 2),
        "turn5_speedup": round(off[4] / on[4], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
