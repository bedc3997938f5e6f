"""The cost of a grammar mask per token, xgrammar beside llguidance, on two vocabularies.

Method: for each vocabulary (SmolLM2's 49,152 tokens, the default model; Qwen2.5's 151,936,
``radixserve pull qwen2.5-coder-0.5b``) and each backend, four JSON Schemas both backends
enforce exactly (a GitHub label, a Kubernetes container port, a shipping address: closed
objects with bounded strings, patterns and enums; and a free JSON object, where every key
and string is open) are compiled, and a matcher walks one fixed valid document of each,
token by token as the model's tokenizer spells it: at each position the mask row is filled
(``Matcher.fill``, the call the sampler makes for every constrained row), then the token is
accepted. Reported: the mean and median fill time per token (microseconds) over all
positions of the four documents, ``--rounds`` walks each (the first, which warms caches, is
not counted), one thread. Prints one JSON line.

    python -m benchmarks.engine.bench_grammar_masks --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from radixserve.structured.backend import allocate_bitmask
from radixserve.structured.grammar import LLGUIDANCE, XGRAMMAR


def closed(**props):
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


CASES = [
    (closed(name={"type": "string", "maxLength": 20},
            color={"type": "string", "pattern": "^[0-9a-f]{6}$"},
            description={"type": "string", "maxLength": 40}),
     {"name": "bug", "color": "d73a4a", "description": "Something is not working"}),
    (closed(containerPort={"type": "integer", "minimum": 1, "maximum": 65535},
            protocol={"enum": ["TCP", "UDP", "SCTP"]}, name={"type": "string", "maxLength": 15}),
     {"containerPort": 8080, "protocol": "TCP", "name": "http"}),
    (closed(shipping_address_line1={"type": "string", "maxLength": 24},
            shipping_postal_code={"type": "string", "pattern": "^[0-9]{5}$"},
            shipping_country_code={"enum": ["US", "FR", "DE", "NO"]},
            is_default_shipping_address={"type": "boolean"}),
     {"shipping_address_line1": "1 Rue de Rivoli", "shipping_postal_code": "75001",
      "shipping_country_code": "FR", "is_default_shipping_address": True}),
    ({"type": "object"},
     {"title": "Notes on grammars", "tags": ["json", "masks"], "pages": 12, "draft": False}),
]  # fmt: skip


def vocabulary_of(model: str | None):
    """(hf tokenizer, vocabulary size, stop ids) of a model, without loading its weights."""
    import gguf

    from radixserve.model.loader import resolve_model_path
    from radixserve.model.tokenizer import Tokenizer

    path = resolve_model_path(model)
    size = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    tok = Tokenizer.from_model_path(path, [])
    return tok.hf, size, tok.eos_token_ids


def walk_times(backend, hf, size: int, stops: list[int], rounds: int) -> list[float]:
    vocab = backend.vocabulary(hf, size, stops)
    mask, times = allocate_bitmask(1, size), []
    for schema, value in CASES:
        text = json.dumps(schema)
        prepared = backend.prepare("json_schema", text)
        compiled = vocab.compile("json_schema", prepared)
        tokens = hf.encode(json.dumps(value), add_special_tokens=False)
        for r in range(rounds + 1):
            m = vocab.matcher(compiled)
            for t in tokens:
                t0 = time.perf_counter()
                m.fill(mask, 0)
                elapsed = time.perf_counter() - t0
                if r:
                    times.append(elapsed)
                if not m.accept(t):
                    raise RuntimeError(f"{backend.name} refused {hf.decode([t])!r} of {value}")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    out = {}
    for model in args.models:
        hf, size, stops = vocabulary_of(model)
        row = {"vocab_size": size}
        for backend in (XGRAMMAR, LLGUIDANCE):
            times = walk_times(backend, hf, size, stops, args.rounds)
            row[backend.name] = {
                "mean_us": round(1e6 * statistics.mean(times), 1),
                "median_us": round(1e6 * statistics.median(times), 1),
                "tokens": len(times),
            }
        row["ratio_mean"] = round(row["llguidance"]["mean_us"] / row["xgrammar"]["mean_us"], 1)
        out[model] = row
    print(json.dumps({"masks": out, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
