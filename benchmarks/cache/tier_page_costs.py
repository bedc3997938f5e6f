"""Part 4 of ``bench_tiers``: what one KV page (16 tokens) costs on each cache tier, against
recomputing it, on the default model (SmolLM2-135M-Instruct, ``--dtype auto``) on this machine.

- recompute: prefill of 512 fresh tokens after a 512-token prefix that is cached, per page
  (the marginal cost of a page in mid-context; chunk of 512, logits of the last token only);
- host -> device and device -> host: ``HostKVPool.restore`` / ``backup`` of 64 pages;
- file: ``FileBackend.set`` / ``get`` of 64 pages in a fresh directory (reads hit the page
  cache: the best case of a warm restart on a machine with free RAM);
- redis: ``RedisBackend.set`` / ``get`` of 64 pages on a valkey-server started here (loopback).

Each figure is the median of ``repeat`` runs. A tier that loads a page slower than the model
recomputes it must not be used; these figures set the defaults of ``load_back_min_tokens`` and
``storage_prefetch_min_tokens``. They alone:
``python -m benchmarks.cache.bench_tiers --skip systems,restart [--repeat 5]``.
"""

from __future__ import annotations

import tempfile

import numpy as np

from benchmarks.common import median_seconds
from radixserve import SamplingParams
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.storage import FileBackend, PageLayout, StorageScope, chain_page_keys
from radixserve.cache.storage.redis_backend import RedisBackend
from radixserve.config import EngineConfig
from radixserve.engine import Engine
from radixserve.model import load_model
from testing.redis_server import RedisServer

PAGE = 16
PAGES = 64


def median_ms(fn, repeat: int) -> float:
    return 1e3 * median_seconds(fn, repeat)


def page_costs(repeat: int = 5) -> dict:
    loaded = load_model(None, dtype="auto", progress=False)
    config = EngineConfig.from_options(load_progress=False, page_size=PAGE, max_total_tokens=16384,
                          chunked_prefill_size=512)  # fmt: skip
    engine = Engine(config, loaded)
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 40000, 512).tolist()
    runs = iter(range(1000))

    def prefill(tokens: list[int]) -> None:
        engine.add_request(f"r{next(runs)}", tokens, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()

    prefill(prefix + [1])  # caches the prefix (and warms the kernels)
    recompute = median_ms(lambda: prefill(prefix + rng.integers(100, 40000, 512).tolist()),
                          repeat) / (512 // PAGE)  # fmt: skip

    pool, n = engine.pool, PAGES * PAGE
    host = HostKVPool(pool, 2 * n, PAGE)
    host_slots, dev_slots = host.alloc(n), engine.allocator.alloc(n)
    to_device = median_ms(lambda: host.restore(host_slots, dev_slots), repeat) / PAGES
    to_host = median_ms(lambda: host.backup(dev_slots, host_slots), repeat) / PAGES

    scope = StorageScope("bench-tier-pages", PageLayout.from_shape(pool.shape, PAGE))
    keys = chain_page_keys(scope, None, rng.integers(100, 40000, n))
    pages = host.pages(host.pages_of(host_slots).tolist())
    out = {
        "model": engine.model_name, "dtype": str(pool.shape.dtype).removeprefix("torch."),
        "bytes_per_token": pool.shape.bytes_per_token(), "page_bytes": host.page_nbytes,
        "recompute_ms_per_page": recompute, "host_to_device_ms_per_page": to_device,
        "device_to_host_ms_per_page": to_host,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        store = FileBackend(d, scope)
        out["file_write_ms_per_page"] = median_ms(lambda: _fresh_set(store, keys, pages),
                                                  repeat) / PAGES  # fmt: skip
        assert store.get(keys, pages) == PAGES
        out["file_read_ms_per_page"] = median_ms(lambda: store.get(keys, pages), repeat) / PAGES
    with RedisServer() as server:
        store = RedisBackend(scope, port=server.port)
        out["redis_write_ms_per_page"] = median_ms(lambda: store.set(keys, pages), repeat) / PAGES
        assert store.get(keys, pages) == PAGES
        out["redis_read_ms_per_page"] = median_ms(lambda: store.get(keys, pages), repeat) / PAGES
        store.close()
    for tier in ("host_to_device", "file_read", "redis_read"):
        out[f"{tier}_vs_recompute"] = out[f"{tier}_ms_per_page"] / recompute
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def _fresh_set(store: FileBackend, keys: list[bytes], pages) -> None:
    store.clear()  # so every repeat writes the pages again
    assert store.set(keys, pages) == PAGES
