"""Which reused tokens to recompute: selection variants compared on the RAG QA set.

Same items, model and reference as ``bench_rag.py`` (a full prefill of each prompt, prefix
caching off); each variant runs every item at every ratio with its segments reused and is
compared with the reference on the first token: agreement and KL(reference || variant) of
the next-token distribution. A variant is ``ANCHORS:SCORE:QUOTA``:

- ``ANCHORS``: the first tokens of each segment always recomputed (EPIC's static picks);
- ``SCORE``: what ranks the rest: ``kv`` (deviation of K and V together at the probe layer),
  ``k``, ``v`` (CacheBlend selects on value deviation), ``attention`` (the attention the
  question's rows, those after the last segment, pay each token at the probe layer),
  ``kvattn`` (``kv`` times ``attention``: deviating tokens the question reads), or
  ``position`` (no probe: the
  earliest tokens of each segment, EPIC's "first tokens of each chunk" with the whole budget);
- ``QUOTA``: ``global`` (top-k over all segments) or ``segment`` (each segment gets a share of
  the budget in proportion to its length and picks its own top-k);
- ``PREFIX`` (optional, default 0): the segments' stored K/V is computed after the prompt's
  first PREFIX tokens (``segment_prefix_tokens``; 0: standalone, from position 0);
- ``LAYER`` (optional, default 1): the probe layer (``segment_deviation_layer``), or ``F-L``:
  layers F to L each scored, each layer's score over its mean, summed; the layers before the
  last are computed for every row, so each one more costs a layer of a full prefill;
- ``FILTER`` (optional, default 0: off): ``MxK``, CacheBlend's gradual filtering in two
  steps: the probe picks K x the budget as candidates, which are computed up to layer M and
  scored again there; the budget is the best of them (``filter_layer``, ``filter_keep``).

With ``--max-tokens N`` (> 1) each run also decodes N greedy tokens and compares the option
it picks (``rag_items.chosen_option``) with the reference's.

Prints a JSON line per item, then one summary line per variant and ratio;
``--from-log LOG [LOG ...]`` summarizes the item lines of earlier runs.
Usage: ``OMP_NUM_THREADS=1 python -m benchmarks.rag.rag_selection --slice 0:6
--variants 4:kv:global,0:v:global --ratios 0.05,0.1,0.15``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.rag.bench_rag import store_all
from benchmarks.rag.rag_items import Runner, build_items, chosen_option, kl
from benchmarks.rag.selection_variants import QUOTAS, SCORES, SelectionVariants
from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.model import load_model


def parse_variant(text: str) -> tuple:
    """``ANCHORS:SCORE:QUOTA[:PREFIX[:LAYER[:FILTER]]]``; LAYER is one probe layer ``L`` or a
    range ``F-L`` whose layers' scores are summed; FILTER ``MxK`` (0: off) scores K x the
    budget again at layer M: (anchors, score, quota, prefix, first, last, filter, keep)."""
    parts = text.split(":")
    parts += ["0", "1", "0"][len(parts) - 3 :] if 3 <= len(parts) <= 6 else []
    ok = len(parts) == 6 and parts[1] in SCORES and parts[2] in QUOTAS
    layers = parts[4].split("-") if ok else []
    filt = parts[5].split("x") if ok else []
    nums = [parts[0], parts[3], *layers, filt[0] if filt else ""]
    ok = ok and len(layers) in (1, 2) and len(filt) in (1, 2) and all(x.isdigit() for x in nums)
    try:
        keep = float(filt[1]) if len(filt) == 2 else 2.0
    except ValueError:
        ok = False
    if not (ok and 1 <= int(layers[0]) <= int(layers[-1]) and keep >= 1):
        raise argparse.ArgumentTypeError(
            f"variant {text!r}: want ANCHORS:SCORE:QUOTA[:PREFIX[:LAYER or FIRST-LAST[:FILTER]]]"
            f", SCORE in {SCORES}, QUOTA in {QUOTAS}, 1 <= FIRST <= LAST, FILTER 0 or MxK, K >= 1"
        )
    return (int(parts[0]), parts[1], parts[2], int(parts[3]), int(layers[0]), int(layers[-1]),
            int(filt[0]), keep)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=30)
    ap.add_argument("--slice", default="0:6", help="A:B, run items A..B-1 of the set")
    ap.add_argument("--pick", help="I,J,...: run these items of the set instead of --slice")
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=512)
    ap.add_argument("--ratios", default="0.05,0.1,0.15")
    ap.add_argument("--variants", default="4:kv:global")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="prompts in the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=1, help="> 1: compare chosen options")
    ap.add_argument("--from-log", type=Path, nargs="+", help="summarize runs' per-item lines")
    args = ap.parse_args()
    if args.from_log:
        summarize(args.from_log)
        return
    try:
        variants = [parse_variant(v) for v in args.variants.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    ratios = [float(x) for x in args.ratios.split(",")]
    torch.set_num_threads(1)
    loaded = load_model(None, "cpu", "float32", progress=False)
    items = build_items(loaded.tokenizer, args.items, args.passages, args.passage_tokens,
                        args.seed, chat=args.chat)  # fmt: skip
    a, b = (int(x) for x in args.slice.split(":"))
    picked = [int(x) for x in args.pick.split(",")] if args.pick else list(range(a, b))
    if not picked or not all(0 <= k < len(items) for k in picked):
        ap.error(f"--slice/--pick: items must be in [0, {len(items)})")
    opts = dict(load_progress=False, dtype="float32", chunked_prefill_size=4096)
    stored = args.items * (args.passage_tokens + 8)
    blend = Runner(
        Engine(EngineConfig.from_options(max_total_tokens=stored + 8192, **opts), loaded)
    )
    full = Runner(
        Engine(
            EngineConfig.from_options(enable_prefix_caching=False, max_total_tokens=8192, **opts),
            loaded,
        )
    )
    one = SamplingParams(temperature=0, max_tokens=1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    text = loaded.tokenizer.decode
    store_all(blend, [items[k] for k in picked], one)  # before any variant: standalone
    seg = blend.engine.segments  # the selection knobs, set per variant (a measurement hook)
    sel = seg.select = SelectionVariants.replacing(seg.select)
    for k in picked:
        item = items[k]
        ref = full.run(item["prompt"], params)
        ref_option = chosen_option(text(ref["tokens"]))
        top = ref["logits"].log_softmax(-1).topk(2)  # how near a tie the reference's token is
        out = {"item": k, "full_option": ref_option, "full_text": text(ref["tokens"]),
               "full_top2_logprob_gap": float(top.values[0] - top.values[1]),
               "by_variant": {}}  # fmt: skip
        for anchors, score, quota, prefix, first, layer, filt, keep in variants:
            seg.prefix_tokens = prefix
            sel.first_tokens, sel.deviation_on, sel.quota = anchors, score, quota
            sel.deviation_from, sel.deviation_layer = first, layer
            sel.filter_layer, sel.filter_keep = filt, keep
            res = {}
            for r in ratios:
                got = blend.run(item["prompt"], params, segments=item["segments"],
                                recompute_ratio=r)  # fmt: skip
                res[r] = {"first": got["tokens"][0] == ref["tokens"][0],
                          "kl": kl(ref["logits"], got["logits"])}  # fmt: skip
                if args.max_tokens > 1:
                    res[r]["text"] = text(got["tokens"])
                    res[r]["option"] = chosen_option(res[r]["text"])
                    res[r]["same_option"] = res[r]["option"] == ref_option
            probe = str(layer) if first == layer else f"{first}-{layer}"
            name = f"{anchors}:{score}:{quota}:{prefix}"
            name += f":{probe}:{filt}x{keep:g}" if filt else (f":{probe}" if probe != "1" else "")
            out["by_variant"][name] = res
        print(json.dumps(out), flush=True)
    blend.engine.check_integrity()


def summarize(paths: list[Path]) -> None:
    rows: dict[tuple[str, str], list[dict]] = {}
    seen = set()
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.startswith('{"item"'):
                continue
            done = json.loads(line)
            for v, res in done["by_variant"].items():
                if (done["item"], v) in seen:
                    continue
                seen.add((done["item"], v))
                for r, x in res.items():
                    rows.setdefault((v, r), []).append(x)
    for (v, r), xs in sorted(rows.items()):
        opts = [x["same_option"] for x in xs if "same_option" in x]
        print(json.dumps({"variant": v, "ratio": float(r), "items": len(xs),
                          "first_token_agreement": sum(x["first"] for x in xs) / len(xs),
                          "option_agreement": sum(opts) / len(opts) if opts else None,
                          "mean_kl": statistics.fmean(x["kl"] for x in xs)}))  # fmt: skip


if __name__ == "__main__":
    main()
