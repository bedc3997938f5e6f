"""Cost of loading one KV page from the storage tier vs recomputing its tokens, side by side.

Layout of the default model (SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head_dim 64),
page sizes 16 and 64, pages in float32 and bfloat16. For each combination, ``--tokens``
tokens' worth of random pages are stored, then timed (median of ``--repeat`` runs):

* ``get`` of all pages in one batch, per page: from the file store with the files in the OS
  page cache (warm), after dropping them from it with fsync + POSIX_FADV_DONTNEED (cold:
  what a restarted machine reads), and from Redis (a valkey-server on loopback);
* ``get`` of a single page (one call, one round trip) from the warm file store and Redis;
* ``set`` of all pages in one batch, per page (a fresh key set each run).

Recomputation is measured on the real engine with the real model and prefix caching, as
the marginal cost of a page: with a cached prefix of C tokens, time a request that computes
the next page plus one token, minus a request that computes only the one token (its whole
prefix cached), median over fresh random prompts. It runs in the engine's ``--dtype``; a
page load is worth it when ``recompute_over_slowest_load`` > 1 (recompute time over the
slowest of the load figures). The 1-minute load average before and after is printed: on a
shared machine compute suffers from other tenants far more than a page read does.

Prints one JSON line. Usage: ``python -m benchmarks.cache.bench_storage [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import median_seconds
from radixserve import SamplingParams
from radixserve.cache.storage import (
    FileBackend,
    PageLayout,
    StorageScope,
    TensorPages,
    chain_page_keys,
    open_backend,
)
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.model import load_model
from testing.redis_server import RedisServer


def median_ms(fn, repeat: int, setup=None) -> float:
    return 1e3 * median_seconds(fn, repeat, setup, warmup=1)  # the first run warms up


def drop_from_page_cache(backend: FileBackend) -> None:
    for path in backend.dir.glob("*/*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_loads(layout: PageLayout, tokens: int, repeat: int, redis_url: str, root: str) -> dict:
    scope = StorageScope("bench-storage", layout)
    n = max(1, tokens // layout.page_size)
    src = TensorPages(torch.randn((n, *layout.page_shape)).to(layout.torch_dtype))
    out = {"page_size": layout.page_size, "dtype": layout.dtype, "pages": n,
           "page_bytes": layout.record_nbytes}  # fmt: skip
    for name, url in (("file", f"file://{root}"), ("redis", redis_url)):
        backend = open_backend(url, scope)
        backend.clear()
        out.update(time_backend(name, backend, src, repeat))
        backend.clear()
        backend.close()
    return out


def time_backend(name: str, backend, src: TensorPages, repeat: int) -> dict:
    layout, n = backend.layout, len(src)
    dst, one = TensorPages.empty(layout, n), TensorPages.empty(layout, 1)
    prompts = iter(range(1, 10**9))  # a fresh prompt per timed set: nothing is stored yet
    batch: list[list[bytes]] = []

    def fresh_keys() -> None:
        ids = np.arange(n * layout.page_size) + next(prompts) * 100_000
        batch[:] = [chain_page_keys(backend.scope, None, ids)]

    set_ms = median_ms(lambda: backend.set(batch[0], src), repeat, setup=fresh_keys)
    keys = chain_page_keys(backend.scope, None, np.arange(n * layout.page_size))
    assert backend.set(keys, src) == n
    get_ms = median_ms(lambda: backend.get(keys, dst), repeat)
    assert backend.get(keys, dst) == n and torch.equal(dst.tensor, src.tensor)
    out = {
        f"{name}_get_ms_per_page": round(get_ms / n, 4),
        f"{name}_get_single_page_ms": round(
            median_ms(lambda: backend.get(keys[:1], one), repeat), 4
        ),
        f"{name}_set_ms_per_page": round(set_ms / n, 4),
    }
    if name == "file":
        cold_ms = median_ms(lambda: backend.get(keys, dst), repeat,
                            setup=lambda: drop_from_page_cache(backend))  # fmt: skip
        out["file_cold_get_ms_per_page"] = round(cold_ms / n, 4)
    return out


def bench_recompute(loaded, page_size: int, context: int, repeat: int, dtype: str) -> float:
    """Marginal ms to compute one page after ``context`` cached tokens (median)."""
    engine = Engine(
        EngineConfig.from_options(
            load_progress=False,
            page_size=page_size,
            dtype=dtype,
            chunked_prefill_size=context + 2 * page_size + 8,
            max_total_tokens=64 * (context + 2 * page_size),
        ),  # fmt: skip
        loaded,
    )
    rng = np.random.default_rng(page_size * 1000 + context)
    serial = iter(range(10**9))

    def run(ids: list[int]) -> float:
        rid = f"r{next(serial)}"
        t0 = time.perf_counter()
        engine.add_request(rid, ids, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - t0) * 1e3

    diffs = []
    for _ in range(repeat + 1):
        ids = rng.integers(100, 40000, context + page_size + 1).tolist()
        if context:
            run(ids[:context] + [5])  # caches the first `context` tokens
        with_page = run(ids)  # computes page_size + 1 tokens
        without = run(ids)  # the page is cached now: computes 1 token
        diffs.append(with_page - without)
    return statistics.median(diffs[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens' worth of pages")
    parser.add_argument("--contexts", default="0,1024", help="cached tokens before the page")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype for recompute")
    busy = "1 on a busy machine, where waiting thread barriers slow compute past its share"
    parser.add_argument("--threads", type=int, default=None, help=f"torch threads; {busy}")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    load_before = os.getloadavg()[0]  # a busy shared machine slows compute more than I/O
    loaded = load_model(None, dtype=args.dtype, progress=False)
    cfg = loaded.model.config
    engine_dtype = str(loaded.model.dtype).removeprefix("torch.")
    rows = []
    with RedisServer() as server, tempfile.TemporaryDirectory() as root:
        for page_size in (16, 64):
            recompute = {c: bench_recompute(loaded, page_size, c, args.repeat, engine_dtype)
                         for c in contexts}  # fmt: skip
            for dtype in ("float32", "bfloat16"):
                layout = PageLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size,
                                    dtype)  # fmt: skip
                row = bench_loads(layout, args.tokens, args.repeat, server.url, root)
                row["recompute_ms_per_page"] = {str(c): round(t, 3) for c, t in recompute.items()}
                slowest = max(
                    row[k] for k in row if k.startswith(("file_", "redis_")) and "_get" in k
                )
                row["recompute_over_slowest_load"] = {
                    str(c): round(t / slowest, 1) for c, t in recompute.items()
                }
                row["per_token_us"] = {
                    k.removesuffix("_ms_per_page"): round(row[k] * 1e3 / page_size, 2)
                    for k in list(row) if k.endswith("_get_ms_per_page")
                }  # fmt: skip
                rows.append(row)
    print(json.dumps({
        "bench": "storage",
        "model": loaded.name,
        "layout": {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
                   "head_dim": cfg.head_dim},
        "recompute_dtype": engine_dtype,
        "threads": torch.get_num_threads(),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "results": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
