"""Code editing with drafts: radixserve with and without drafts vs llama.cpp's server with and
without its n-gram drafts, on the same prompts, side by side.

Method. Each prompt is a chat turn holding one of radixserve's own source files (150-300
lines) and asking for the whole file back with one identifier renamed (``--files``:
``path:old:new``; round r appends ``_r`` to the new name, so no round repeats an earlier
answer). The answer is mostly the file again: text the request's own prompt holds, what
drafts turn into speed. Four servers are started once on free loopback ports, serving the
same GGUF file (default: Qwen2.5-Coder-0.5B Q4_K_M) with ``--threads`` CPU threads each:

- ``radix``: radixserve with every draft source (``--draft-sources grammar,text,cache``);
- ``radix-nodrafts``: ``--draft-sources none``;
- ``llamacpp``: llama.cpp's server (``xllamacpp``), no drafts;
- ``llamacpp-<spec>``: the same with a model-free draft type (``--llamacpp-spec``, default
  ``ngram_mod``).

One request at a time (1 stream), greedy, no repetition penalty on either server, streamed
``/v1/chat/completions``, the systems in a rotated order per file and round, so a drift of
the shared machine's speed hits all. Decode
tokens/s of a request: ``(output_tokens - 1) / (end - first token)``; a system's figure is its
tokens over its decode time, all requests together. Also: whether radixserve's answers are
the same with and without drafts (they must be), and radixserve's draft statistics.

Prints one JSON line. Usage: ``python -m benchmarks.engine.bench_code_edit [--rounds 1]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import httpx

from radixserve.bench import baselines
from radixserve.bench.client import RequestRecord, check_server, request_body, stream_request
from radixserve.bench.processes import read_metrics

FILES = (
    "radixserve/cache/kv_pool.py:shape:kv_shape",
    "radixserve/model/gguf_file.py:offset:start",
    "radixserve/cache/tree_check.py:node:tree_node",
)
ROOT = Path(__file__).resolve().parents[2]


def prompt(path: str, old: str, new: str) -> list[dict]:
    source = (ROOT / path).read_text()
    ask = (f"Here is `{path}`:\n\n```python\n{source}```\n\nRename `{old}` to `{new}` "
           "everywhere in this file. Reply with the whole updated file in one code block, "
           "nothing else.")  # fmt: skip
    return [{"role": "user", "content": ask}]


async def edit(client, url: str, model: str, messages: list[dict], max_tokens: int):
    body = request_body("chat", model, messages, max_tokens, 0.0)
    # the model's generation config asks for a repetition penalty of 1.05, which radixserve
    # applies by default (and a penalised request never drafts); llama.cpp applies none
    body["repetition_penalty"] = 1.0
    record = RequestRecord(conversation_id="edit", turn=1, start_time=0.0)
    text = await stream_request(client, url, "chat", body, record)
    if not record.success:
        raise RuntimeError(f"request to {url} failed: {record.error}")
    return record, text


async def measure(servers: dict[str, str], args) -> dict:
    tokens = {name: 0 for name in servers}
    seconds = {name: 0.0 for name in servers}
    per_request: dict[str, list[float]] = {name: [] for name in servers}
    same, k = True, 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        models = {name: await check_server(client, url) for name, url in servers.items()}
        for name, url in servers.items():  # warm-up: first requests pay one-off costs
            await edit(client, url, models[name], [{"role": "user", "content": "Hi"}], 8)
        for r in range(args.rounds):
            for spec in args.files:
                path, old, new = spec.split(":")
                messages = prompt(path, old, f"{new}_{r}" if r else new)
                names = list(servers)
                order = names[k % len(names) :] + names[: k % len(names)]
                k += 1
                answers = {}
                for name in order:
                    rec, answers[name] = await edit(client, servers[name], models[name],
                                                    messages, args.max_tokens)  # fmt: skip
                    decode = rec.e2e - rec.ttft
                    tokens[name] += rec.output_tokens - 1
                    seconds[name] += decode
                    per_request[name].append(round((rec.output_tokens - 1) / decode, 1))
                if "radix" in answers and "radix-nodrafts" in answers:
                    same &= answers["radix"] == answers["radix-nodrafts"]
    out = {name: round(tokens[name] / seconds[name], 1) for name in servers}
    return {"decode_tokens_per_s": out, "per_request": per_request, "radix_same_answers": same,
            "output_tokens": tokens}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--files", nargs="+", default=list(FILES), help="path:old:new ...")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-spec", default="ngram_mod")
    parser.add_argument("--systems", default="radix,radix-nodrafts,llamacpp,llamacpp-spec")
    parser.add_argument("--radix-args", default="", help="extra `radixserve serve` flags")
    args = parser.parse_args()
    from radixserve.model.loader import resolve_model_path

    model = str(resolve_model_path(args.model))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-code-edit-"))
    base = baselines.ServerSettings(model=model, slots=1, context_length=8192,
                                    threads=args.threads, log_dir=log_dir)  # fmt: skip
    extra = tuple(args.radix_args.split())
    systems = {
        "radix": ("radix", dataclasses.replace(
            base, radix_args=("--draft-sources", "grammar,text,cache", *extra))),
        "radix-nodrafts": ("radix", dataclasses.replace(
            base, radix_args=(*extra, "--draft-sources", "none"))),
        "llamacpp": ("llamacpp", base),
        "llamacpp-spec": ("llamacpp", dataclasses.replace(
            base, llamacpp_args=("--spec", args.llamacpp_spec))),
    }  # fmt: skip
    chosen = args.systems.split(",")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # radixserve's engine inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    with contextlib.ExitStack() as stack:
        managed = {}
        for name in chosen:
            kind, settings = systems[name]
            command = baselines.command(kind, settings)
            managed[name] = stack.enter_context(baselines.ManagedServer(name, command, settings))
        result = asyncio.run(measure({n: s.base_url for n, s in managed.items()}, args))
        if "radix" in managed:
            metrics = read_metrics(managed["radix"].base_url, {})
            result["radix_drafts"] = {k: v for k, v in metrics.items()
                                      if k.startswith("draft_") and v}  # fmt: skip
    rate = result["decode_tokens_per_s"]
    ratios = {}
    if "radix" in rate and "radix-nodrafts" in rate:
        ratios["drafts_vs_none"] = round(rate["radix"] / rate["radix-nodrafts"], 2)
    for peer in ("llamacpp", "llamacpp-spec"):
        if "radix" in rate and peer in rate:
            ratios[f"radix_vs_{peer}"] = round(rate["radix"] / rate[peer], 2)
    print(json.dumps({"bench": "code_edit", "model": args.model, "threads": args.threads,
                      "llamacpp_spec": args.llamacpp_spec, "files": args.files,
                      "rounds": args.rounds, **result, "ratios": ratios}))  # fmt: skip


if __name__ == "__main__":
    main()
