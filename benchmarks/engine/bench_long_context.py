"""Long agent sessions (8K-32K tokens) through the OpenAI API: radixserve's KV dtypes against
llama.cpp's server on the same GGUF file, same thread count, one run.

Method. Each system is started on its own (one at a time, so they never share the cores) on
a free loopback port: ``radix`` (float KV, the model's dtype), ``radix-int8``
(``--kv-cache-dtype int8``), ``llamacpp`` (its default f16 KV; ``--llamacpp-flash`` sets its
flash attention, default ``auto``), one slot of ``max(lengths)`` plus the rounds' tokens. For
each length L in ``--lengths`` a new session of random token ids (so no earlier session's
cache helps) runs ``--rounds`` rounds of streamed ``/v1/completions``, greedy,
``ignore_eos``:

- round 1: the L-token prompt, ``max_tokens=1``: cold prefill tokens/s = L / time to first
  token;
- each later round: the previous prompt, its output and a new ``--tool-tokens``-token "tool
  result", generating ``--new-tokens``: its time to first token (the prefix is cached on both
  servers) and its decode tokens/s = (output tokens - 1) / (end - first token), at L+ tokens
  of context.

Per system and length: ``prefill_tps``, ``later_ttft_s`` (median of the later rounds),
``decode_tps`` (the last round's), and ``rss_mb``, the resident memory of the server's
process group after the session. Ratios radix/llamacpp where both ran. Prints one JSON line.
Usage: ``python -m benchmarks.engine.bench_long_context --model qwen2.5-coder-0.5b
--lengths 8192,16384,32768 --threads 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

from radixserve.bench import baselines
from radixserve.bench.client import RequestRecord, check_server, stream_request

SYSTEMS = {"radix": (), "radix-int8": ("--kv-cache-dtype", "int8"), "llamacpp": ()}


async def complete(client, url, model, prompt: list[int], max_tokens: int) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    record = RequestRecord(conversation_id="session", turn=1, start_time=0.0)
    await stream_request(client, url, "completions", body, record)
    if not record.success:
        raise RuntimeError(f"request to {url} failed: {record.error}")
    return record


async def session(url: str, length: int, args, rng: np.random.Generator) -> dict:
    """One agent session of ``length`` tokens and its later rounds on the server at ``url``."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(7200.0)) as client:
        model = await check_server(client, url)
        await complete(client, url, model, rng.integers(100, 40000, 64).tolist(), 2)  # warm-up
        prompt = rng.integers(100, 40000, length).tolist()
        first = await complete(client, url, model, prompt, 1)
        ttfts, decode = [], 0.0
        for _ in range(args.rounds - 1):
            # the session grows by a tool result: a prompt that extends the last one, so both
            # servers reuse its cached prefix
            prompt = prompt + rng.integers(100, 40000, args.tool_tokens).tolist()
            r = await complete(client, url, model, prompt, args.new_tokens)
            ttfts.append(r.ttft)
            decode = (r.output_tokens - 1) / max(r.e2e - r.ttft, 1e-9)
    return {
        "prefill_tps": round(length / first.ttft, 1),
        "later_ttft_s": round(statistics.median(ttfts), 2) if ttfts else None,
        "decode_tps": round(decode, 2),
    }


def run_system(name: str, args, log_dir: Path) -> dict:
    context = max(args.lengths) + args.rounds * (args.tool_tokens + args.new_tokens) + 64
    flags = (*SYSTEMS[name], *(("--max-total-tokens", str(context)) if name != "llamacpp" else ()))
    settings = baselines.ServerSettings(model=args.model, slots=1, context_length=context,
                                        threads=args.threads, radix_args=flags,
                                        log_dir=log_dir, startup_timeout=600)  # fmt: skip
    argv = baselines.command("llamacpp" if name == "llamacpp" else "radix", settings)
    if name == "llamacpp":
        base = argv
        argv = lambda port: [*base(port), "--flash-attn", args.llamacpp_flash]  # noqa: E731
    out = {}
    with baselines.ManagedServer(name, argv, settings) as server:
        for length in args.lengths:
            rng = np.random.default_rng(length)
            result = asyncio.run(session(server.base_url, length, args, rng))
            result["rss_mb"] = round(server.rss_bytes() / 2**20)
            out[str(length)] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a .gguf file or name")
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tool-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default="radix,radix-int8,llamacpp")
    parser.add_argument("--llamacpp-flash", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - set(SYSTEMS):
        parser.error(f"--systems takes some of {', '.join(SYSTEMS)}")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (a cold prefill, then later rounds)")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # radixserve's engine inherits it
    log_dir = Path(tempfile.mkdtemp(prefix="bench-long-"))
    result = {name: run_system(name, args, log_dir) for name in systems}
    out = {"bench": "long_context", "model": args.model, "threads": args.threads,
           "lengths": args.lengths, "rounds": args.rounds, "tool_tokens": args.tool_tokens,
           "new_tokens": args.new_tokens, "llamacpp_flash": args.llamacpp_flash,
           **result}  # fmt: skip
    if "llamacpp" in result:
        peer = result["llamacpp"]
        for name in (s for s in systems if s != "llamacpp"):
            out[f"ratio_{name}_vs_llamacpp"] = {
                length: {k: round(r[k] / peer[length][k], 2) for k in r
                         if r[k] and peer[length].get(k)}
                for length, r in result[name].items()
            }  # fmt: skip
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
