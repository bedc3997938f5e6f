"""Micro-benchmark of the radix tree: match, insert and eviction costs.

Method: a ``RadixCache`` over a ``PagedAllocator`` (no KV tensors: the tree is index-only).
Token ids are int32 numpy arrays, the form the engine keeps them in; a list input adds a
conversion (reported separately as ``match_list_input_us``). Each figure is the median of
several repetitions, in microseconds.

1. One cached sequence of N tokens (1K, 16K, 128K, 200K): ``match_prefix`` of that sequence
   plus a new turn, ``insert`` of a new N-token sequence into an empty tree, and ``insert`` of
   the sequence when it is already cached (the common case when a chat turn finishes).
2. 10,000 conversations of ~256 tokens behind one 2K-token system prompt: match and insert
   of one more conversation.
3. Eviction with 100K and 1M tokens cached in 64-token leaves under shared 1K prefixes:
   microseconds per evicted token, evicting 64K tokens.

Prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from benchmarks.common import median_seconds
from radixserve.cache import PagedAllocator, RadixCache

RNG = np.random.default_rng(0)


def tokens(n: int) -> np.ndarray:
    return RNG.integers(0, 49152, n, dtype=np.int32)


def timed(fn, repeat: int = 7) -> float:
    return round(1e6 * median_seconds(fn, repeat), 2)  # microseconds


def insert_new(cache: RadixCache, seq: np.ndarray) -> None:
    """Cache ``seq`` the way a finished request does: only its uncached suffix gets slots."""
    m = cache.match_prefix(seq)
    cache.insert(seq, torch.cat([m.device_indices, cache.allocator.alloc(len(seq) - m.device_len)]))


def bench_long_prefix(n: int) -> dict:
    seq = tokens(n)
    query = np.concatenate([seq, tokens(64)])
    query_list = query.tolist()

    def fresh_insert():
        cache = RadixCache(PagedAllocator(n + 1024))
        slots = cache.allocator.alloc(n)
        t0 = time.perf_counter()
        cache.insert(seq, slots)
        return (time.perf_counter() - t0) * 1e6

    insert_us = round(statistics.median(fresh_insert() for _ in range(5)), 2)
    cache = RadixCache(PagedAllocator(n + 1024))
    insert_new(cache, seq)
    slots = cache.match_prefix(seq).device_indices
    return {
        "cached_tokens": n,
        "match_us": timed(lambda: cache.match_prefix(query)),
        "match_list_input_us": timed(lambda: cache.match_prefix(query_list)),
        "insert_new_us": insert_us,
        "insert_cached_us": timed(lambda: cache.insert(seq, slots)),
    }


def bench_many_conversations(num_convs: int = 10_000, system_len: int = 2048) -> dict:
    system = tokens(system_len)
    cache = RadixCache(PagedAllocator(system_len + num_convs * 300 + 4096))
    for _ in range(num_convs):
        insert_new(cache, np.concatenate([system, tokens(int(RNG.integers(128, 384)))]))
    new_conv = np.concatenate([system, tokens(256)])
    slots = cache.allocator.alloc(256)

    def match_and_insert():
        m = cache.match_prefix(new_conv)
        cache.insert(new_conv, torch.cat([m.device_indices, slots]))

    return {
        "conversations": num_convs,
        "system_prompt_tokens": system_len,
        "cached_tokens": cache.total_size(),
        "match_us": timed(lambda: cache.match_prefix(new_conv)),
        "match_and_insert_us": timed(match_and_insert, repeat=1),
    }


def bench_eviction(total_tokens: int, evict_tokens: int = 65_536) -> dict:
    cache = RadixCache(PagedAllocator(total_tokens))
    prefixes = [tokens(1024) for _ in range(max(1, total_tokens // 65_536))]
    while cache.allocator.free_size() >= 1024 + 64:
        prefix = prefixes[int(RNG.integers(len(prefixes)))]
        insert_new(cache, np.concatenate([prefix, tokens(64)]))
    cached = cache.total_size()
    t0 = time.perf_counter()
    freed = cache.evict(evict_tokens)
    elapsed = (time.perf_counter() - t0) * 1e6
    return {
        "cached_tokens": cached,
        "evicted_tokens": freed,
        "us_per_evicted_token": round(elapsed / freed, 4),
    }


def main() -> None:
    result = {
        "bench": "radix",
        "long_prefix": [bench_long_prefix(n) for n in (1024, 16_384, 131_072, 200_000)],
        "shared_system_prompt": bench_many_conversations(),
        "eviction": [bench_eviction(n) for n in (100_000, 1_000_000)],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
