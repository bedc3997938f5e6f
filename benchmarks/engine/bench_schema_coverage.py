"""Which real JSON Schemas each grammar backend enforces, and whether the outputs validate.

Method: the schemas are the JSONSchemaBench sample vendored in
``benchmarks/engine/data/jsonschemabench/`` (550: 55 drawn at random from each of its ten
splits; licences in its README). Each is judged twice, without a model: by xgrammar alone
(its support check and exact rewrites: ``XGrammarBackend.prepare``), and by the two
backends together as the server judges it (``choose_backend``: xgrammar, else llguidance).
A schema is *compiled* (a backend enforces it exactly), *refused* (valid, but no backend
enforces it: the server's 400, counted by the keyword it names) or *invalid* (the grammar
engines reject it as a schema). Then, with ``--outputs K`` > 0, the first K schemas of each
split that each backend enforces (of ``--backends``; under ``--max-schema-bytes``, without a
``$ref`` to another document) each get one greedy chat request for a JSON document through one
in-process engine (the default model unless ``--model``), ``--streams`` at a time, and
every completed output (finish "stop") must parse and validate against its schema with
``jsonschema`` (formats as annotations, its default); ``max_tokens`` cut-offs are counted
apart, by backend. Prints one JSON line.

    python -m benchmarks.engine.bench_schema_coverage --outputs 4 --backends xgrammar
    python -m benchmarks.engine.bench_schema_coverage --outputs 3 --backends llguidance
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path

SAMPLE = Path(__file__).parent / "data" / "jsonschemabench" / "sample.jsonl.gz"


def load_sample() -> list[dict]:
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def judge(text: str) -> tuple[str, str, str | None]:
    """(xgrammar alone, the two together, reason of the refusal by the two): each verdict
    "compiled" / "refused" / "invalid", or the backend's name for the two together."""
    from radixserve.structured.grammar import XGRAMMAR, choose_backend
    from radixserve.structured.schema_support import UnsupportedSchema

    verdicts = []
    for decide in (lambda: XGRAMMAR.prepare("json_schema", text),
                   lambda: choose_backend("json_schema", text)[0].name):  # fmt: skip
        try:
            out = decide()
            verdicts.append(out if out in ("xgrammar", "llguidance") else "compiled")
        except UnsupportedSchema as e:
            verdicts.append(("refused", e.detail))
        except (ValueError, RecursionError):
            verdicts.append("invalid")
    alone, both = verdicts
    reason = both[1] if isinstance(both, tuple) else None
    as_word = lambda v: v[0] if isinstance(v, tuple) else v  # noqa: E731
    return as_word(alone), as_word(both), reason


def keyword(detail: str) -> str:
    """The construct a refusal names, without the values in its message."""
    if "$ref" in detail:
        return "$ref outside the schema"
    construct = detail.split(" is not supported")[0]
    return construct if len(construct) <= 60 else construct[:57] + "..."


def coverage(rows: list[dict]) -> tuple[dict, dict, list]:
    table: dict[str, Counter] = defaultdict(Counter)
    reasons: Counter = Counter()
    verdicts = []
    for row in rows:
        text = json.dumps(row["schema"])
        alone, both, reason = judge(text)
        verdicts.append((row, text, both))
        t = table[row["split"]]
        t["schemas"] += 1
        t[f"xgrammar_{alone}"] += 1
        t["both_" + ("compiled" if both in ("xgrammar", "llguidance") else both)] += 1
        if both in ("xgrammar", "llguidance"):
            t[f"both_by_{both}"] += 1
        if reason:
            reasons[keyword(reason)] += 1
    total = sum(table.values(), Counter())
    return (
        {**{k: dict(v) for k, v in sorted(table.items())}, "total": dict(total)},
        dict(reasons.most_common()),
        verdicts,
    )


def outputs(args, verdicts) -> dict:
    from benchmarks.engine.bench_structured import check_outputs, run_pass
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine

    chosen, taken = [], Counter()
    for row, text, both in verdicts:
        if both not in args.backends or len(text) > args.max_schema_bytes:
            continue
        if '"$ref": "http' in text or taken[row["split"], both] >= args.outputs:
            continue
        taken[row["split"], both] += 1
        chosen.append((row, text, both))
    engine = Engine(EngineConfig.from_options(model=args.model, load_progress=False,
                                              draft_sources="grammar",
                                              draft_max_batch=2))  # fmt: skip
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": "Write a short JSON document "
                                 f"for this schema: {row['schema'].get('title', row['file'])}"}])
               for row, _, _ in chosen]  # fmt: skip
    schemas = [text for _, text, _ in chosen]
    _, outs, reasons = run_pass(engine, prompts, schemas, args.max_tokens, args.streams, True)
    engine.check_integrity()
    result = {}
    for backend in args.backends:
        ids = [i for i, (_, _, b) in enumerate(chosen) if b == backend]
        result[backend] = {"run": len(ids), **check_outputs(
            tok, {i: outs[i] for i in ids}, reasons, schemas)}  # fmt: skip
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--outputs", type=int, default=0,
                    help="schemas per split and backend to generate for")  # fmt: skip
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"],
                    help="generate for the schemas these backends enforce")  # fmt: skip
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--max-schema-bytes", type=int, default=8000)
    args = ap.parse_args()
    rows = load_sample()
    table, reasons, verdicts = coverage(rows)
    out = {"schemas": len(rows), "coverage": table, "refusal_reasons": reasons}
    if args.outputs:
        out["outputs"] = outputs(args, verdicts)
        out.update(model=args.model or "smollm2-135m", max_tokens=args.max_tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
