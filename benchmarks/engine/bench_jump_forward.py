"""Jump forward: tokens/s of constrained decoding with grammar-forced tokens computed ahead
as drafts, against token-by-token constrained decoding, on schemas with long fixed keys.

Method: request bodies shaped like real APIs' (every key required, so the grammar forces each
key and its punctuation), one greedy chat request per schema and prompt, ``--streams`` at a
time, through two in-process engines on the same weights: jump forward off, and on in
batches up to ``--max-batch`` requests (default ``--streams``: drafts in every step). Each
round asks for every schema with ``--copies`` prompts worded as no earlier round worded
them (a server sees the same schemas in new requests), off then on; the first round is the
first time either engine sees the schemas. Tokens/s are generated tokens over wall time;
each round's ratio is measured side by side, and the figure is the best round of each.
Every request's output token ids must be identical between the two engines
(``identical``, over all rounds). Prints one JSON line.

    python -m benchmarks.engine.bench_jump_forward --streams 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json


def _schema(keys: dict[str, dict]) -> str:
    return json.dumps({"type": "object", "properties": keys, "required": list(keys),
                       "additionalProperties": False})  # fmt: skip


_S = {"type": "string", "maxLength": 16}
_I = {"type": "integer", "minimum": 0, "maximum": 100000}
_B = {"type": "boolean"}
SCHEMAS = {
    "repository settings": _schema({"allow_squash_merge": _B, "allow_merge_commit": _B,
        "delete_branch_on_merge": _B, "allow_auto_merge": _B, "has_vulnerability_alerts": _B}),
    "checkout session": _schema({"billing_address_collection": {"enum": ["auto", "required"]},
        "customer_email_address": _S, "payment_method_types": {"enum": ["card", "sepa_debit"]},
        "success_redirect_url": _S, "cancel_redirect_url": _S}),
    "block device mapping": _schema({"device_name": _S, "delete_on_termination": _B,
        "volume_size_in_gibibytes": _I, "volume_type": {"enum": ["gp3", "io2", "st1"]},
        "encrypted_at_rest": _B}),
    "container probe": _schema({"initial_delay_seconds": _I, "period_seconds": _I,
        "timeout_seconds": _I, "success_threshold": _I, "failure_threshold": _I}),
    "shipping address": _schema({"shipping_address_line1": _S, "shipping_postal_code": _S,
        "shipping_country_code": {"enum": ["US", "FR", "DE", "NO"]},
        "is_default_shipping_address": _B}),
    "server settings": _schema({"server_configuration_name": _S,
        "maximum_concurrent_connections": _I, "request_timeout_in_milliseconds": _I,
        "enable_transport_layer_security": _B}),
}  # fmt: skip


ASKS = ["Write the {} as JSON.", "JSON for a {}, please.", "Give me a {} in JSON.",
        "Produce an example {} as a JSON object.", "I need a JSON {}.",
        "Return a sample {} encoded as JSON.", "Show a {} in JSON form.",
        "Make up a realistic {} and write it as JSON."]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--copies", type=int, default=2, help="prompts per schema and round")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="the jump-forward engine's draft_max_batch (default: --streams, "
                    "so it drafts in every step)")  # fmt: skip
    args = ap.parse_args()
    if args.copies * args.rounds > len(ASKS):
        ap.error(f"--copies times --rounds must be at most {len(ASKS)} (the prompt wordings)")
    from benchmarks.engine.bench_structured import run_pass
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine
    from radixserve.model import load_model

    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    max_batch = args.streams if args.max_batch is None else args.max_batch
    engines = {
        jump: Engine(EngineConfig.from_options(model=args.model, load_progress=False,
                                               max_total_tokens=16384,
                                               draft_sources="grammar",
                                               draft_max_batch=max_batch * jump),
                     loaded)
        for jump in (False, True)
    }  # fmt: skip
    tok = engines[False].tokenizer
    rates: dict[bool, list[float]] = {False: [], True: []}
    identical, tokens = True, 0
    for r in range(args.rounds):
        prompts, schemas = [], []
        for ask in ASKS[r * args.copies : (r + 1) * args.copies]:
            for name, schema in SCHEMAS.items():
                prompts.append(tok.encode_chat([{"role": "user", "content": ask.format(name)}]))
                schemas.append(schema)
        outs = {}
        for jump in (False, True):
            rate, outs[jump], _ = run_pass(engines[jump], prompts, schemas, args.max_tokens,
                                           args.streams, True)  # fmt: skip
            rates[jump].append(rate)
        identical &= outs[True] == outs[False]
        tokens += sum(len(v) for v in outs[True].values())
    for e in engines.values():
        e.check_integrity()
    grammar = engines[True].stats().drafts.sources["grammar"]
    off, on = max(rates[False]), max(rates[True])
    print(json.dumps({
        "model": args.model or "smollm2-135m", "dtype": args.dtype, "streams": args.streams,
        "max_batch": max_batch,
        "requests": len(SCHEMAS) * args.copies * args.rounds, "tokens": tokens,
        "tokens_per_s": {"token_by_token": round(off, 1), "jump_forward": round(on, 1)},
        "speedup": round(on / off, 3), "identical": identical,
        "round_speedups": [round(b / a, 3) for a, b in zip(rates[False], rates[True], strict=True)],
        "forced_tokens": grammar.accepted_tokens, "drafted_tokens": grammar.proposed_tokens,
        "rounds": {str(k): [round(r, 1) for r in v] for k, v in rates.items()},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
