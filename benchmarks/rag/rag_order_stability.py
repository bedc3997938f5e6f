"""How stable is the model's own answer when only the documents' order changes?

A yardstick for ``bench_rag.py``'s agreement figures: the same RAG QA items (``rag_items``),
each run twice with a full prefill (prefix caching off, no segments): once as built, once with
its documents in reverse order (same labels "Document 1:" .. in place, same question). Two
exact computations of prompts that differ only in an order a RAG retriever does not control;
compared as ``bench_rag.py`` compares a blended run with the full prefill: first token, chosen
option (``rag_items.chosen_option``), KL(as built || reversed) of the first next-token
distribution, and the as-built prompt's top-2 log-prob gap (how near a tie its first token is).

Prints a JSON line per item, then the summary line. Usage:
``OMP_NUM_THREADS=1 python -m benchmarks.rag.rag_order_stability --items 30 --slice 0:15``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.rag.rag_items import Runner, build_items, chosen_option, kl, sliced
from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.model import load_model


def reversed_documents(item: dict) -> list[int]:
    """The item's prompt with its documents' tokens in reverse order, labels left in place."""
    prompt, segments = list(item["prompt"]), item["segments"]
    docs = [prompt[s:e] for s, e in segments]
    if len({len(d) for d in docs}) != 1:
        raise ValueError("reversing needs documents of one length (their slots are swapped)")
    for (s, e), doc in zip(segments, reversed(docs), strict=True):
        prompt[s:e] = doc
    return prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=30)
    ap.add_argument("--slice", default=None, help="A:B, run only items A..B-1 of the set")
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--chat", action="store_true", help="prompts in the model's chat template")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(None, "cpu", "float32", progress=False)
    items = build_items(loaded.tokenizer, args.items, args.passages, args.passage_tokens,
                        args.seed, chat=args.chat)  # fmt: skip
    items, first = sliced(items, args.slice, ap.error)
    config = EngineConfig.from_options(enable_prefix_caching=False, max_total_tokens=8192,
                          load_progress=False, chunked_prefill_size=4096)  # fmt: skip
    full = Runner(Engine(config, loaded))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    text = loaded.tokenizer.decode
    rows = []
    for n, item in enumerate(items):
        ref = full.run(item["prompt"], params)
        other = full.run(reversed_documents(item), params)
        top2 = ref["logits"].log_softmax(-1).topk(2).values
        ref_text, other_text = text(ref["tokens"]), text(other["tokens"])
        row = {
            "item": first + n,
            "first": ref["tokens"][0] == other["tokens"][0],
            "same_option": chosen_option(ref_text) == chosen_option(other_text),
            "kl": kl(ref["logits"], other["logits"]),
            "top2_logprob_gap": float(top2[0] - top2[1]),
            "text": ref_text,
            "reversed_text": other_text,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "items": len(rows),
        "first_token_agreement": sum(r["first"] for r in rows) / len(rows),
        "answer_agreement_option": sum(r["same_option"] for r in rows) / len(rows),
        "mean_kl": statistics.fmean(r["kl"] for r in rows),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
