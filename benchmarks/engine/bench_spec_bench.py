"""Spec-Bench per category: decode tokens/s with drafts as a user gets them, with none and with
every source, and whether the answers are the same.

Method. The questions are Spec-Bench's (``data/spec_bench/``: 480 in 13 categories, the usual
benchmark of speculative decoding); the first ``--per-category`` of each category are asked,
in file order. A question of MT-Bench's categories has two turns, asked as Spec-Bench asks
them: the second turn's request holds the first turn and the model's own answer to it. One
server per draft setting (``draft_ab.SYSTEMS``: ``defaults``, ``none``, ``all``) serves the
same GGUF file (default Qwen2.5-Coder-0.5B Q4_K_M) with ``--threads`` threads; one request at
a time (1 stream), greedy, no repetition penalty, at most ``--max-tokens`` output tokens per
turn, the settings in a rotated order per question. The server times each request
(``draft_ab.Server.chat``). A category's figure per setting is its decode tokens over its
decode seconds, every turn of every question together; ``ratios`` divide by ``none``'s.
Also per category: draft tokens proposed and the share kept, per source, and whether every
setting wrote the same answers token for token (they must).

``--time-limit`` stops asking after so many seconds, and SIGTERM at once, each with the report
of the questions asked of every setting (``questions_asked``).
Prints one JSON line. Small scope (a few minutes on 2 cores):
``python -m benchmarks.engine.bench_spec_bench --per-category 1 --max-tokens 64``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import signal
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_model
from benchmarks.engine.draft_ab import Tally, add_systems_arg, ratios, rotated, start_servers

QUESTIONS = Path(__file__).parent / "data" / "spec_bench" / "question.jsonl.gz"


class Stopped(Exception):
    """SIGTERM (``timeout``): report what was measured, then stop the servers."""


def stop(*_: object) -> None:
    raise Stopped


def questions(per_category: int, categories: list[str] | None) -> list[dict]:
    """The first ``per_category`` questions of each category (or of ``categories``), in
    file order."""
    taken: dict[str, int] = {}
    out = []
    with gzip.open(QUESTIONS, "rt", encoding="utf-8") as f:
        for line in f:
            q = json.loads(line)
            cat = q["category"]
            if categories is not None and cat not in categories:
                continue
            if taken.get(cat, 0) < per_category:
                taken[cat] = taken.get(cat, 0) + 1
                out.append(q)
    missing = set(categories or ()) - set(taken)
    if missing:
        raise SystemExit(f"--categories: no such category {sorted(missing)}")
    return out


def ask(server, turns: list[str], max_tokens: int) -> tuple[list[str], Tally]:
    """Every turn of a question, each with the earlier turns and answers: answers, tally."""
    messages: list[dict] = []
    answers, tally = [], Tally()
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        message, t = server.chat(messages, max_tokens)
        tally.add(t)
        answers.append(message.get("content") or "")
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers, tally


def run(args: argparse.Namespace) -> dict:
    names = args.systems.split(",")
    picked = questions(args.per_category, args.categories)
    by_cat: dict[str, dict[str, Tally]] = {}
    same: dict[str, bool] = {}
    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, names, args.model, args.threads, args.context_length)
        start, asked = time.monotonic(), 0
        for k, q in enumerate(picked):
            if args.time_limit and time.monotonic() - start > args.time_limit:
                break  # the report says how many were asked
            cat = q["category"]
            answers, tallies = {}, {}
            try:
                for name in rotated(names, k):
                    answers[name], tallies[name] = ask(servers[name], q["turns"], args.max_tokens)
            except Stopped:
                break  # a question not asked of every setting is left out
            asked += 1
            for name, t in tallies.items():
                by_cat.setdefault(cat, {n: Tally() for n in names})[name].add(t)
            tallies = by_cat[cat]
            same[cat] = same.get(cat, True) and len({json.dumps(a) for a in answers.values()}) == 1
            so_far = {n: round(t.rate, 2) for n, t in tallies.items()}
            print(f"spec_bench: {k + 1}/{len(picked)} {cat} {so_far}", file=sys.stderr, flush=True)
    categories, total = {}, {n: Tally() for n in names}
    for cat, tallies in by_cat.items():
        for n, t in tallies.items():
            total[n].add(t)
        categories[cat] = {**{n: t.summary() for n, t in tallies.items()},
                           "ratios": ratios({n: t.rate for n, t in tallies.items()}),
                           "same_outputs": same[cat]}  # fmt: skip
    overall_ratios = ratios({n: t.rate for n, t in total.items()})
    worst = {}
    for n in names:
        key = f"{n}_vs_none"
        if n != "none" and "none" in names and categories:
            cat = min(categories, key=lambda c: categories[c]["ratios"].get(key, 0.0))
            worst[n] = {"category": cat, "ratio": categories[cat]["ratios"].get(key)}
    return {"categories": categories, "overall": {n: t.summary() for n, t in total.items()},
            "overall_ratios": overall_ratios, "worst_category": worst,
            "same_outputs": all(same.values()), "questions": len(picked),
            "questions_asked": asked}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--per-category", type=int, default=2, help="questions per category")
    parser.add_argument("--categories", nargs="+", help="only these categories")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="seconds after which no question starts (0: none)")  # fmt: skip
    add_systems_arg(parser)
    args = parser.parse_args()
    if args.per_category < 1 or args.max_tokens < 1:
        parser.error("--per-category and --max-tokens must be >= 1")
    signal.signal(signal.SIGTERM, stop)
    result = run(args)
    print(json.dumps({"bench": "spec_bench", "model": args.model, "threads": args.threads,
                      "per_category": args.per_category, "max_tokens": args.max_tokens,
                      "cpu": cpu_model(), **result}))  # fmt: skip


if __name__ == "__main__":
    main()
