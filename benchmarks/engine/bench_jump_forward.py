"""Jump forward: tokens/s of constrained decoding with grammar-forced tokens computed ahead
in one chunk, against token-by-token constrained decoding, on schemas with long fixed keys.

Method: request bodies shaped like real APIs' (every key required, so the grammar forces each
key and its punctuation), one greedy chat request per schema and prompt, ``--streams`` at a
time, through two in-process engines on the same weights: jump forward off and on. The two
passes alternate ``--rounds`` times (the first round warms the prefix cache of both); tokens/s
are generated tokens over wall time, best round of each. Every request's output token ids
must be identical between the two engines (``identical``). Prints one JSON line.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--copies", type=int, default=2, help="prompts per schema")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from benchmarks.engine.bench_structured import run_pass
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine
    from radixserve.model import load_model

    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    engines = {
        jump: Engine(EngineConfig.from_options(model=args.model, load_progress=False,
                                               max_total_tokens=16384, jump_forward=jump),
                     loaded)
        for jump in (False, True)
    }  # fmt: skip
    tok = engines[False].tokenizer
    prompts, schemas = [], []
    for copy in range(args.copies):
        for name, schema in SCHEMAS.items():
            ask = f"Write the {name} as JSON." if copy == 0 else f"JSON for a {name}, please."
            prompts.append(tok.encode_chat([{"role": "user", "content": ask}]))
            schemas.append(schema)
    rates: dict[bool, list[float]] = {False: [], True: []}
    outs: dict[bool, dict] = {}
    for _ in range(args.rounds):
        for jump in (False, True):
            rate, out, _ = run_pass(engines[jump], prompts, schemas, args.max_tokens,
                                    args.streams, True)  # fmt: skip
            rates[jump].append(rate)
            outs[jump] = out
    for e in engines.values():
        e.check_integrity()
    stats = engines[True].grammar_stats()
    off, on = max(rates[False]), max(rates[True])
    print(json.dumps({
        "model": args.model or "smollm2-135m", "dtype": args.dtype, "streams": args.streams,
        "requests": len(prompts), "tokens": sum(len(v) for v in outs[True].values()),
        "tokens_per_s": {"token_by_token": round(off, 1), "jump_forward": round(on, 1)},
        "speedup": round(on / off, 3), "identical": outs[True] == outs[False],
        "forced_tokens": stats.forced_tokens, "drafted_tokens": stats.drafted_tokens,
        "rounds": {str(k): [round(r, 1) for r in v] for k, v in rates.items()},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
