"""Decode and prefill speed through the OpenAI API: radixserve vs llama.cpp's server, one run.

Method. Both servers are started once, on free loopback ports, serving the same GGUF file
(default: SmolLM2-135M-Instruct) with the same number of CPU threads (``--threads``: llama.cpp's
``n_threads``, and ``OMP_NUM_THREADS`` for radixserve's engine); llama.cpp gets one slot per
stream. Each measurement runs on one server, then the same on the other (A B A B ...),
``--repeat`` times; the figures are medians, so a drift of the shared machine's speed hits both.
Every request is a streamed ``/v1/completions`` call with a token-id prompt (random ids, a new
prompt each time, so no prompt cache helps), greedy, ``ignore_eos``:

- decode, 1 stream: one request generating ``--new-tokens`` tokens and, just before it, one
  generating a single token from a prompt of the same length; tokens/s is
  ``(output_tokens - 1) / (end of the first - end of the second)``, i.e. decode only. (Not
  timed from the first streamed text: tokens that print nothing, such as special tokens a
  model emits past its end of text under ``ignore_eos``, stream no text, so that clock can
  start at the last token.)
- decode, N streams (``--streams``): N such requests sent at once; aggregate tokens/s is the
  sum of their output tokens over the wall time from the first request sent to the last
  finished (their short prompts' prefill included, as a server sees it).
- prefill: one ``--prefill-tokens``-token prompt with ``max_tokens=1``; tokens/s is
  ``prompt_tokens / time to first token``.

Also reported, per server: ``startup_s`` (process start to a healthy ``/health``, the model
load included) and ``rss_mb`` (resident memory of the server's process group after the
measurements); for radixserve also ``engine_rss_mb`` (its engine process alone),
``kv_used_mb`` (the KV slots held or cached at the end, from ``/metrics``) and
``engine_rss_budget_mb``: the weights file + ``kv_used_mb`` + 600 MB, the engine's memory
target. With ``--agreement`` (and both servers), the greedy answers to 8 chat prompts
(``radixserve/bench/agreement.py``: 32 tokens, repetition penalty off on both; 8 completion
prompts for a model whose file has no chat template, a base model) are compared,
each disagreement classed as a near tie or a real difference by radixserve's logprobs.

Prints one JSON line: each figure for both servers and our/llama.cpp ratios. Extra flags for
``radixserve serve`` go in ``--radix-args`` (e.g. ``--radix-args "--quantization none"``).
Usage: ``python -m benchmarks.engine.bench_decode_vs_llamacpp [--repeat 3] [--streams 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from radixserve.bench import baselines
from radixserve.bench.agreement import greedy_agreement
from radixserve.bench.client import RequestRecord, check_server, stream_request

PROMPT_LEN = 32  # decode prompts: short, so the figure is decode


async def one_request(client, url, model, prompt, max_tokens) -> RequestRecord:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord(conversation_id="bench", turn=1, start_time=0.0)
    await stream_request(client, url, "completions", body, record)
    if not record.success:
        raise RuntimeError(f"request to {url} failed: {record.error}")
    return record


class Prompts:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def next(self, n: int) -> list[int]:
        return self.rng.integers(100, 40000, n).tolist()


async def decode_streams(client, url, model, prompts, streams: int, new_tokens: int) -> float:
    if streams == 1:
        first = await one_request(client, url, model, prompts.next(PROMPT_LEN), 1)
        r = await one_request(client, url, model, prompts.next(PROMPT_LEN), new_tokens)
        return (r.output_tokens - 1) / (r.e2e - first.e2e)
    t0 = time.perf_counter()
    records = await asyncio.gather(
        *(one_request(client, url, model, prompts.next(PROMPT_LEN), new_tokens)
          for _ in range(streams))
    )  # fmt: skip
    wall = time.perf_counter() - t0
    return sum(r.output_tokens for r in records) / wall


async def prefill(client, url, model, prompts, n: int) -> float:
    r = await one_request(client, url, model, prompts.next(n), 1)
    return r.prompt_tokens / r.ttft


async def check_agreement(servers: dict[str, str], chat_model: bool) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        return await greedy_agreement(client, servers, chat_model=chat_model)


def has_chat_template(model: str | None) -> bool:
    """Does the served GGUF file carry a chat template (a chat model, not a base model)?"""
    from radixserve.model.gguf_file import GGUFFile
    from radixserve.model.loader import resolve_model_path

    return "tokenizer.chat_template" in GGUFFile(resolve_model_path(model)).fields


async def measure(servers: dict[str, str], args) -> dict:
    prompts = Prompts()
    samples: dict[str, dict[str, list[float]]] = {
        name: {"decode_1": [], "decode_n": [], "prefill": []} for name in servers
    }
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        models = {name: await check_server(client, url) for name, url in servers.items()}
        for name, url in servers.items():  # warm-up: first requests pay one-off costs
            await decode_streams(client, url, models[name], prompts, 2, 8)
            await prefill(client, url, models[name], prompts, 256)
        for _ in range(args.repeat):
            for name, url in servers.items():
                m, s = models[name], samples[name]
                s["decode_1"].append(
                    await decode_streams(client, url, m, prompts, 1, args.new_tokens)
                )
                s["decode_n"].append(
                    await decode_streams(client, url, m, prompts, args.streams, args.new_tokens)
                )
                s["prefill"].append(await prefill(client, url, m, prompts, args.prefill_tokens))
    return {
        name: {k: round(statistics.median(v), 1) for k, v in s.items()}
        | {f"{k}_samples": [round(x, 1) for x in v] for k, v in s.items()}
        for name, s in samples.items()
    }


def engine_memory(server: baselines.ManagedServer, model: str | None) -> dict[str, int]:
    """The engine process's resident memory against its target (see the module's docstring)."""
    from radixserve.bench.processes import read_metrics
    from radixserve.model.loader import resolve_model_path

    metrics = read_metrics(server.base_url, {})
    kv = metrics["kv_cache_used_tokens"] * metrics["kv_cache_bytes_per_token"] / 2**20
    weights = resolve_model_path(model).stat().st_size / 2**20
    return {
        "engine_rss_mb": round(server.largest_child_rss_bytes() / 2**20),
        "kv_used_mb": round(kv),
        "engine_rss_budget_mb": round(weights + kv + 600),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--radix-args", default="", help="extra `radixserve serve` flags")
    parser.add_argument("--systems", default="radix,llamacpp", help="radix, llamacpp or both")
    parser.add_argument(
        "--agreement", action="store_true", help="also compare greedy answers to chat prompts"
    )
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - {"radix", "llamacpp"}:
        parser.error("--systems takes radix, llamacpp or both")
    context = args.prefill_tokens + 256
    log_dir = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    settings = baselines.ServerSettings(
        model=args.model,
        slots=args.streams,
        context_length=context,
        threads=args.threads,
        radix_args=(*shlex.split(args.radix_args), "--max-running-requests", str(args.streams)),
        log_dir=log_dir,
    )
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # radixserve's engine inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    with contextlib.ExitStack() as stack:
        managed = {}
        for name in systems:
            server = baselines.ManagedServer(name, baselines.command(name, settings), settings)
            managed[name] = stack.enter_context(server)
        servers = {name: server.base_url for name, server in managed.items()}
        agreement = None
        if args.agreement:
            agreement = asyncio.run(check_agreement(servers, has_chat_template(args.model)))
        result = asyncio.run(measure(servers, args))
        for name, server in managed.items():
            result[name]["startup_s"] = round(server.startup_s or 0.0, 1)
            result[name]["rss_mb"] = round(server.rss_bytes() / 2**20)
        if "radix" in managed:
            result["radix"] |= engine_memory(managed["radix"], args.model)
    out = {
        "bench": "decode_vs_llamacpp",
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "streams": args.streams,
        "prefill_tokens": args.prefill_tokens,
        "radix_args": args.radix_args,
        "repeat": args.repeat,
        **result,
    }
    if agreement is not None:
        out["greedy_agreement"] = agreement
    if len(systems) == 2:
        ours, peer = result["radix"], result["llamacpp"]
        out["ratio_vs_llamacpp"] = {
            k: round(ours[k] / peer[k], 2) for k in ("decode_1", "decode_n", "prefill")
        }
        out["ratio_vs_llamacpp"]["startup"] = round(ours["startup_s"] / peer["startup_s"], 2)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
