"""Eviction cost per page of each eviction policy, against LRU's, in the engine's tree.

Method: a ``RadixCache`` over a ``PagedAllocator`` (index-only, page size 1 unless
``--page-size``) filled to ``--tokens`` (10^6) with conversations of 64-320 tokens below
shared 1,024-token prefixes, a quarter of them used again (matched) as they are cached, so a
learning policy has hits, leaf classes and returns to rank by. A first eviction of a tenth of
the measured amount warms the policy (its eviction age, its estimates); then ``--evict-pages``
(10^5) pages are evicted in one ``evict`` call, timed. Every policy fills the same tree from
the same tokens, and the policies take turns round by round (``--rounds``), so a noisy machine
slows them alike; the figure is the median over rounds of microseconds per evicted page, and
its ratio to LRU's. Filling time per cached token is reported too (ranking a leaf happens
when it is cached or used, not only when the pool evicts).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from benchmarks.common import cpu_model
from radixserve.cache import EVICTION_POLICIES, PagedAllocator, RadixCache


def fill(cache: RadixCache, rng: np.random.Generator) -> None:
    alloc = cache.allocator
    prefixes = [rng.integers(0, 49152, 1024, dtype=np.int32) for _ in range(16)]
    while alloc.free_size() >= 1024 + 320:
        seq = np.concatenate(
            [prefixes[int(rng.integers(16))],
             rng.integers(0, 49152, int(rng.integers(64, 321)), dtype=np.int32)]
        )  # fmt: skip
        m = cache.match_prefix(seq)
        cache.insert(seq, torch.cat([m.device_indices, alloc.alloc(len(seq) - m.device_len)]))
        if rng.random() < 0.25:
            cache.match_prefix(seq)  # used again


def one_round(policy: str, args: argparse.Namespace, seed: int) -> dict:
    cache = RadixCache(PagedAllocator(args.tokens, args.page_size), policy)
    t0 = time.perf_counter()
    fill(cache, np.random.default_rng(seed))
    fill_s = time.perf_counter() - t0
    cached = cache.total_size()
    cache.evict(args.evict_pages * args.page_size // 10)  # warm the policy
    t0 = time.perf_counter()
    freed = cache.evict(args.evict_pages * args.page_size)
    evict_s = time.perf_counter() - t0
    return {"us_per_page": 1e6 * evict_s / (freed / args.page_size),
            "fill_us_per_token": 1e6 * fill_s / cached, "cached_tokens": cached}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--evict-pages", type=int, default=100_000)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    args = p.parse_args()
    policies = args.policies.split(",")
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {name: [] for name in policies}
    for r in range(args.rounds):
        for name in policies:
            runs[name].append(one_round(name, args, seed=r))
    lru = statistics.median(x["us_per_page"] for x in runs["lru"]) if "lru" in runs else None
    result = {"bench": "eviction", "cpu": cpu_model(), "tokens": args.tokens,
              "evict_pages": args.evict_pages, "page_size": args.page_size,
              "rounds": args.rounds, "policies": {}}  # fmt: skip
    for name, xs in runs.items():
        us = statistics.median(x["us_per_page"] for x in xs)
        result["policies"][name] = {
            "us_per_page": round(us, 3),
            "vs_lru": round(us / lru, 3) if lru else None,
            "fill_us_per_token": round(statistics.median(x["fill_us_per_token"] for x in xs), 3),
            "cached_tokens": xs[0]["cached_tokens"],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
