"""Engine benchmark on the default model (SmolLM2-135M-Instruct), side by side in one run.

1. Prefill of a 2K-token prompt: our forward (one chunk, logits of the last position only)
   vs transformers' ``model(input_ids)`` on the same GGUF weights (logits for every position,
   as a user calls it); also transformers with ``logits_to_keep=1`` for reference. Median of
   ``--repeat`` runs, tokens/s.
2. Decode throughput at batch 1, 8 and 32: each request a 128-token prompt, 64 greedy tokens
   (``ignore_eos``); tokens/s over the decode steps only (prefill excluded).
3. A 5-turn chat whose history reaches ~1.5K tokens: time to the first token of each turn,
   with the cache on and off (the same conversation, replayed with fixed answers so both see
   the same prompts). Reports turns 2 and 5 and the speed-up.

Prints one JSON line. Usage: ``python benchmarks/bench_engine.py [--repeat 3] [--dtype float32]``.
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


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_prefill(loaded, reference, repeat: int, n: int = 2048) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 40000, n).tolist()
    engine = Engine(EngineConfig(load_progress=False, chunked_prefill_size=n,
                                 enable_prefix_caching=False, max_total_tokens=n + 64), loaded)

    def ours():
        engine.add_request("p", ids, SamplingParams(max_tokens=1))
        engine.step()
        assert not engine.has_unfinished()

    x = torch.tensor([ids])

    def hf_full():
        with torch.inference_mode():
            reference(x)

    def hf_last():
        with torch.inference_mode():
            reference(x, logits_to_keep=1)

    t_ours, t_full, t_last = (median_time(f, repeat) for f in (ours, hf_full, hf_last))
    return {
        "prompt_tokens": n,
        "ours_tokens_per_s": round(n / t_ours, 1),
        "transformers_tokens_per_s": round(n / t_full, 1),
        "transformers_last_logits_tokens_per_s": round(n / t_last, 1),
        "speedup_vs_transformers": round(t_full / t_ours, 2),
        "speedup_vs_transformers_last_logits": round(t_last / t_ours, 2),
    }


def bench_decode(loaded, batch: int, prompt_len: int = 128, new_tokens: int = 64) -> dict:
    rng = np.random.default_rng(batch)
    engine = Engine(EngineConfig(load_progress=False, max_total_tokens=batch * 256 + 256,
                                 chunked_prefill_size=batch * prompt_len,
                                 max_running_requests=batch), loaded)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", rng.integers(100, 40000, prompt_len).tolist(), params)
    engine.step()  # the whole batch's prefill
    decoded, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        decoded += len(engine.step())
    elapsed = time.perf_counter() - t0
    return {"batch": batch, "tokens_per_s": round(decoded / elapsed, 1)}


def bench_multiturn(loaded, caching: bool) -> dict:
    """TTFT per turn of a 5-turn chat; answers are fixed text so both runs see the same turns."""
    llm = LLM.from_engine(Engine(EngineConfig(load_progress=False, max_total_tokens=16384,
                                              enable_prefix_caching=caching,
                                              chunked_prefill_size=4096), loaded))
    topic = ("Explain, in detail, how a radix tree stores shared prefixes of many strings, "
             "how lookups walk the edges, and why splitting an edge keeps every key intact. ")
    answer = ("A radix tree keeps each shared run of symbols once; children hang off the first "
              "symbol of their edge, and a lookup compares whole runs at a time. " * 6)
    history: list[dict] = [{"role": "system", "content": topic * 4}]
    ttfts, prompt_lens = [], []
    for turn in range(5):
        history.append({"role": "user", "content": f"Question {turn + 1}: " + topic * 2})
        t0 = time.perf_counter()
        tracker = None
        for _, tracker in llm.stream(history, SamplingParams(temperature=0, max_tokens=1)):
            pass
        ttfts.append(time.perf_counter() - t0)
        prompt_lens.append(tracker.prompt_tokens)
        history.append({"role": "assistant", "content": answer})
    return {"ttft_s": [round(t, 4) for t in ttfts], "prompt_tokens": prompt_lens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    loaded = load_model(None, dtype=args.dtype, progress=False)
    path = loaded.path
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=getattr(torch, args.dtype)).eval()
    result = {"bench": "engine", "dtype": args.dtype, "threads": torch.get_num_threads(),
              "prefill": bench_prefill(loaded, reference, args.repeat)}
    del reference
    decode = [bench_decode(loaded, b) for b in (1, 8, 32)]
    result["decode"] = decode
    result["decode_batch32_vs_batch1"] = round(decode[2]["tokens_per_s"] / decode[0]["tokens_per_s"], 2)
    on, off = bench_multiturn(loaded, True), bench_multiturn(loaded, False)
    result["multiturn"] = {
        "prompt_tokens_per_turn": on["prompt_tokens"],
        "ttft_cache_on_s": on["ttft_s"], "ttft_cache_off_s": off["ttft_s"],
        "turn2_speedup": round(off["ttft_s"][1] / on["ttft_s"][1], 2),
        "turn5_speedup": round(off["ttft_s"][4] / on["ttft_s"][4], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
