"""Greedy agreement of llama.cpp with itself: the same file served with two micro-batch sizes.

Method. llama.cpp's CPU backend picks its matmul kernels by the number of rows (a tiled or
repacked kernel for a prompt's micro-batch, one-row dot products for a decode step), and on a
quantized model it rounds every matmul's input to int8 per block on each of them, in slightly
different ways. Its logits therefore depend on how a prompt is batched. This measures how
much that moves its greedy output: two llama.cpp servers on the same GGUF file, one with its
default micro-batch (512 tokens: a prompt in one micro-batch) and one with ``--ubatch``
tokens (1: every prompt token through the one-row path, as decode steps are; or any other
llama.cpp flags with ``--second-args``), each prompt
sent once to each, greedy, ``--new-tokens`` tokens, repetition penalty off
(``radixserve/bench/agreement.py``: the 8 chat prompts, or 8 completion openers for a file
without a chat template). With ``--radix`` radixserve serves it too, and every pair is
compared. A disagreement is placed at the first differing token and classed by the first
server's two best log-probabilities there (a near tie: under 0.5 nats apart).

That figure bounds what agreement with llama.cpp can mean on a model whose greedy choices
are near ties: an engine that computed exactly what one of llama.cpp's two batchings
computes would still part from the other where llama.cpp parts from itself.

Prints one JSON line. Usage:
``python -m benchmarks.engine.llamacpp_self_agreement --model gemma3-270m --threads 2 --radix``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import httpx

from benchmarks.engine.bench_decode_vs_llamacpp import has_chat_template
from radixserve.bench import baselines
from radixserve.bench.agreement import (
    CHAT_PROMPTS,
    COMPLETION_PROMPTS,
    chat,
    compare,
    complete,
)


async def answers(servers: dict[str, str], chat_model: bool, n: int) -> dict[str, list[dict]]:
    """Every prompt once to every server (a repeat would meet llama.cpp's prompt cache)."""
    out: dict[str, list[dict]] = {name: [] for name in servers}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for prompt in CHAT_PROMPTS if chat_model else COMPLETION_PROMPTS:
            for name, url in servers.items():
                if chat_model:
                    out[name].append(await chat(client, url, name, prompt, n))
                else:  # every server gives logprobs: any of them may be a pair's reference
                    out[name].append(await complete(client, url, name, prompt, n, True))
    return out


def pairs(got: dict[str, list[dict]], chat_model: bool) -> dict[str, dict]:
    prompts = CHAT_PROMPTS if chat_model else COMPLETION_PROMPTS
    report = {}
    for a, b in itertools.combinations(got, 2):
        results = [compare(p, {a: x, b: y}, a) for p, x, y in zip(prompts, got[a], got[b],
                                                                   strict=True)]  # fmt: skip
        report[f"{a} vs {b}"] = {
            "agree": sum(r.agree for r in results),
            "prompts": len(results),
            "results": [asdict(r) for r in results],
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m", help="a .gguf file or known name")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--ubatch", type=int, default=1, help="the second server's micro-batch")
    parser.add_argument("--second-args", default=None,
                        help="the second server's llama.cpp flags instead of --ubatch's "
                             "(e.g. '--flash-attn off --kv-type f32')")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--radix", action="store_true", help="radixserve serves the file too")
    parser.add_argument("--radix-args", default="", help="extra `radixserve serve` flags")
    args = parser.parse_args()
    if args.ubatch < 1 or args.threads < 1 or args.new_tokens < 1:
        parser.error("--ubatch, --threads and --new-tokens must be >= 1")
    settings = baselines.ServerSettings(
        model=args.model, slots=1, context_length=1024, threads=args.threads,
        radix_args=tuple(args.radix_args.split()), log_dir=Path(tempfile.mkdtemp()),
    )  # fmt: skip
    base = baselines.command("llamacpp", settings)
    second = args.second_args.split() if args.second_args is not None else [
        "--ubatch", str(args.ubatch)]  # fmt: skip
    label = "-".join(a.lstrip("-") for a in second) or "same"
    argvs = {"llamacpp": base, f"llamacpp:{label}": lambda port: [*base(port), *second]}
    if args.radix:
        argvs["radix"] = baselines.command("radix", settings)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    chat_model = has_chat_template(args.model)
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, argv in argvs.items():
            server = baselines.ManagedServer(name.replace(":", "-"), argv, settings)
            servers[name] = stack.enter_context(server).base_url
        got = asyncio.run(answers(servers, chat_model, args.new_tokens))
    out = {
        "bench": "llamacpp_self_agreement",
        "model": args.model,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "mode": "chat" if chat_model else "completion",
        "pairs": pairs(got, chat_model),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
