"""Pins under load: a pinned long system prompt keeps being served from the cache while the
hierarchical-cache benchmark's chat load evicts everything else, and the pin budget holds.

Method:

1. Load: ``bench_tiers``'s chat workload (``--conversations`` ShareGPT chats x ``--turns``
   turns, all in flight, turns interleaved, a shared ``--system-prompt-chars`` system prompt,
   ``--output-len``-token answers), on a device pool of ``--device-tokens`` (page size 16),
   far smaller than the live set.
2. Two agents beside it, each visiting every ``--visit-interval`` seconds while the load runs
   (and once more after it): one chat request of a fixed system prompt of about
   ``--agent-prompt-tokens`` tokens (4,096 by default) and a new short question
   (one output token). The ``pinned`` agent asks for its system prompt to be pinned
   (``cache_pin``: the first message, for an hour); the ``unpinned`` agent, with another
   system prompt of the same length, does not.
3. A visit is a hit when its cached prompt tokens reach the pinned prefix's size (the
   server's ``radix_pinned_tokens`` after the first visit) less one page. Hit rates are over
   the visits after each agent's first. ``/metrics`` is read after every visit: the largest
   ``radix_pinned_tokens`` seen against ``radix_pin_budget_tokens`` (``--pin-budget`` of the
   pool), the tokens evicted, and the pin events.
4. Systems: ``device-only`` (the device pool alone) and ``+host`` (with a host tier of
   ``--host-kv-memory``), each a fresh ``radixserve serve`` of the default model, or with
   ``--tiny-model`` of a tiny random Llama (2 layers, width 64) with the default model's
   tokenizer and chat template: the same token streams through the same cache at a small
   fraction of the compute (hit rates and pins are properties of the cache; the answers, and
   so the histories, are the random model's).

Prints one JSON line. Usage: ``python -m benchmarks.cache.bench_pins [--conversations 48]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.cache.bench_tiers import (
    PAGE,
    add_chat_load_args,
    drive,
    make_workload,
    serve_argv,
)
from radixserve.bench import client as api
from radixserve.bench.baselines import ManagedServer, ServerSettings
from radixserve.bench.workloads import words


async def agent_prompt(client, url: str, model: str, seed: int, tokens: int) -> str:
    """Fixed words cut to about ``tokens`` tokens, measured by the server's tokenizer
    (``/v1/messages/count_tokens``: nothing is computed)."""
    text = " ".join(words(random.Random(seed), tokens * 2))
    chars = tokens * 3
    for _ in range(3):
        body = {"model": model, "messages": [{"role": "user", "content": text[:chars]}]}
        r = await client.post(url + "/v1/messages/count_tokens", json=body)
        r.raise_for_status()
        chars = int(chars * tokens / r.json()["input_tokens"])
    return text[:chars]


def read_metrics(url: str) -> dict[str, float]:
    """The pin and eviction figures of ``/metrics``."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0]
        if name in ("radix_pinned_tokens", "radix_pin_budget_tokens", "radix_evicted_tokens_total"):
            out[name] = float(line.rsplit(" ", 1)[1])
        elif name == "radix_pin_events_total":
            event = line.split('event="')[1].split('"')[0]
            out[f"pin_{event}"] = float(line.rsplit(" ", 1)[1])
    return out


async def visit(client, url: str, model: str, system: str, pin: bool, n: int) -> dict:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Question {n}: what is rule {n}?"}]  # fmt: skip
    body = api.request_body("chat", model, messages, 1, 0.0)
    if pin:
        body["cache_pin"] = {"messages": 1, "ttl": "1h"}
    record = api.RequestRecord(f"agent-{pin}", n, 0.0)
    await api.stream_request(client, url, "chat", body, record)
    if not record.success:
        raise RuntimeError(f"agent visit {n}: {record.error}")
    return {"cached": record.cached_tokens, "prompt": record.prompt_tokens, "ttft": record.ttft}


async def agents(url: str, args, done: asyncio.Event) -> dict:
    visits: dict[bool, list[dict]] = {True: [], False: []}
    samples: list[dict] = []
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        model = await api.check_server(client, url)
        prompts = {pin: await agent_prompt(client, url, model, seed, args.agent_prompt_tokens)
                   for pin, seed in ((True, 1), (False, 2))}  # fmt: skip
        n = 0
        while True:
            last = done.is_set()
            for pin in (True, False):
                visits[pin].append(await visit(client, url, model, prompts[pin], pin, n))
                samples.append(await asyncio.to_thread(read_metrics, url))
            n += 1
            if last:
                break
            try:
                await asyncio.wait_for(done.wait(), args.visit_interval)
            except TimeoutError:
                pass
    return {"visits": visits, "samples": samples}


def summarize(found: dict, load: list[dict]) -> dict:
    samples, visits = found["samples"], found["visits"]
    pinned_tokens = samples[0].get("radix_pinned_tokens", 0)  # after the pinned agent's first
    need = max(pinned_tokens - PAGE, 1)

    def hit_rate(vs: list[dict]) -> float:
        later = vs[1:]
        return sum(v["cached"] >= need for v in later) / max(len(later), 1)

    last = samples[-1]
    return {
        "pinned_prefix_tokens": pinned_tokens,
        "agent_prompt_tokens": visits[True][0]["prompt"],
        "visits": len(visits[True]),
        "pinned_hit_rate": hit_rate(visits[True]),
        "unpinned_hit_rate": hit_rate(visits[False]),
        "pinned_cached": [v["cached"] for v in visits[True]],
        "unpinned_cached": [v["cached"] for v in visits[False]],
        "ttft_median_s": {
            kind: statistics.median(v["ttft"] for v in visits[pin][1:])
            if len(visits[pin]) > 1
            else None
            for kind, pin in (("pinned", True), ("unpinned", False))
        },  # fmt: skip
        "load_requests": len(load),
        "load_hit_rate": sum(r["cached"] for r in load) / max(sum(r["prompt"] for r in load), 1),
        "evicted_tokens": last.get("radix_evicted_tokens_total", 0),
        "budget_tokens": last.get("radix_pin_budget_tokens", 0),
        "max_pinned_tokens": max(s.get("radix_pinned_tokens", 0) for s in samples),
        "pin_events": {k: v for k, v in last.items() if k.startswith("pin_")},
    }


async def run_load_and_agents(url: str, conversations, args) -> tuple[list[dict], dict]:
    done = asyncio.Event()
    agent_task = asyncio.create_task(agents(url, args, done))
    await asyncio.sleep(args.agent_head_start)  # the pinned prompt is pinned before the load
    try:
        load = await drive(url, conversations, range(1, args.turns + 1), args, {})
    finally:
        done.set()
    return load, await agent_task


def run_system(name: str, conversations, args, log_dir: Path) -> dict:
    flags = ["--max-model-len", str(args.max_model_len), "--chunked-prefill-size", "256",
             "--max-total-tokens", str(args.device_tokens),
             "--pin-budget", str(args.pin_budget)]  # fmt: skip
    if name == "+host":
        flags += ["--host-kv-memory", args.host_kv_memory]
    if args.model:
        flags += ["--model", args.model]
    settings = ServerSettings(log_dir=log_dir, startup_timeout=900)
    with ManagedServer(name, serve_argv(flags), settings) as server:
        start = time.perf_counter()
        load, found = asyncio.run(run_load_and_agents(server.base_url, conversations, args))
        elapsed = time.perf_counter() - start
    return {"system": name, "flags": " ".join(flags), "wall_s": elapsed} | summarize(found, load)


def tiny_model(path: Path, context: int) -> str:
    """A tiny random Llama with the default model's tokenizer, saved at ``path``."""
    from radixserve.model.loader import default_model_path
    from radixserve.model.tokenizer import Tokenizer
    from testing.tiny_model import save_tiny_hf_model

    save_tiny_hf_model(path, max_position_embeddings=context)
    Tokenizer.from_model_path(default_model_path(), eos_token_ids=[2]).hf.save_pretrained(path)
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_chat_load_args(p, max_model_len=6144, device_tokens=10000)
    p.add_argument("--pin-budget", type=float, default=0.45)
    p.add_argument("--host-kv-memory", default="2GiB", help="the +host system's host tier")
    p.add_argument("--agent-prompt-tokens", type=int, default=4096)
    p.add_argument("--visit-interval", type=float, default=20.0)
    p.add_argument("--agent-head-start", type=float, default=5.0)
    p.add_argument("--systems", default="device-only,+host")
    p.add_argument("--tiny-model", action="store_true", help="serve a tiny random Llama")
    p.add_argument("--request-timeout", type=float, default=900.0)
    args = p.parse_args()
    # SIGTERM unwinds like an exception, so the servers started here are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    args.workload = "chat"  # what bench_tiers.drive and make_workload read
    workload = make_workload(args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-pins-"))
    args.model = tiny_model(log_dir / "tiny", args.max_model_len) if args.tiny_model else None
    rows = []
    for name in args.systems.split(","):
        rows.append(run_system(name, workload.conversations, args, log_dir))
        print(json.dumps(rows[-1]), file=sys.stderr)  # each system as it ends
    print(json.dumps({"params": vars(args), "systems": rows}))


if __name__ == "__main__":
    sys.exit(main())
