"""The hierarchical cache through real servers (tiny model, separate engine processes).

- Warm restart: a server with a file store, stopped and started again, answers a
  conversation's next turn with ``cached_tokens >= history - page_size``, all of it counted
  as storage hits (``cached_tokens_by_tier``); ``/clear_kv_storage`` then empties the store.
- Two servers sharing one Redis (a real valkey-server on a free port): the second one's first
  request on a prefix the first one computed is a storage hit.
- What users see: the usage split in chat responses, per-tier counters in ``/metrics``, the
  tiers in ``/cache``.

Each starts two server processes (about 20-45 s per test on 2 cores); both run in CI.
``test_tiered_engine.py`` covers the same paths one layer down.

Turns are sent as token ids to ``/generate`` (the random tiny model's text need not
re-tokenize to the same ids, which would end a text chat's match inside the answer).
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testing.redis_server import RedisServer
from testing.server import running_server

PAGE = 16
# a stored block per page: the tests count pages
ARGS = ["--dtype", "float32", "--page-size", str(PAGE), "--max-total-tokens", "512",
        "--host-kv-memory", "2MiB", "--chunked-prefill-size", "128",
        "--kv-storage-block-tokens", str(PAGE)]  # fmt: skip
RNG = np.random.default_rng(8)
STARTUP_S = 600  # a loaded CI machine can take minutes to start a server


def turn(url: str, ids: list[int], max_tokens: int = 16) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": max_tokens,
                                                  "ignore_eos": True}}  # fmt: skip
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def samples(url: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[(s.name, *sorted((k, v) for k, v in s.labels.items() if k != "model_name"))] = (
                s.value
            )
    return out


def wait_written(url: str, pages: int, timeout: float = 30) -> None:
    key = ("kv_tier_pages_moved_total", ("direction", "host_to_storage"))
    deadline = time.monotonic() + timeout
    while samples(url).get(key, 0) < pages:
        assert time.monotonic() < deadline, "pages were not written to storage"
        time.sleep(0.2)


@pytest.mark.slow  # tens of seconds alone; runs in `make test-all`
def test_warm_restart_answers_the_next_turn_from_storage(tiny_model_dir, tmp_path):
    store = tmp_path / "kv"
    args = ["--model", str(tiny_model_dir), *ARGS, "--kv-storage", f"file://{store}"]
    first = RNG.integers(100, 40000, 150).tolist()
    with running_server(*args, timeout=STARTUP_S) as url:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello there"}]})  # fmt: skip
        assert chat.status_code == 200, chat.text
        split = chat.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
        assert split == {"device": 0, "host": 0, "storage": 0}
        answer = turn(url, first)
        history = first + answer["output_ids"]
        wait_written(url, (len(history) - 1) // PAGE)
        cache = httpx.get(url + "/cache").json()
        assert cache["tiers"]["host_cached_tokens"] >= 160
        assert cache["tiers"]["storage_url"] == f"file://{store}"
    assert len(list(store.rglob("*.kv"))) >= (len(history) - 1) // PAGE
    with running_server(
        *args, timeout=STARTUP_S
    ) as url:  # a new process: its device and host tiers are empty
        out = turn(url, history + RNG.integers(100, 40000, 20).tolist())
        meta = out["meta_info"]
        assert meta["cached_tokens"] >= len(history) - PAGE, (meta, len(history))
        assert meta["cached_tokens_by_tier"]["storage"] == meta["cached_tokens"]
        m = samples(url)
        assert (
            m[("radix_cache_hit_tokens_by_tier_total", ("tier", "storage"))]
            == meta["cached_tokens"]
        )
        assert m[("kv_tier_pages_moved_total", ("direction", "storage_to_host"))] >= 10
        assert m[("kv_load_back_seconds_count",)] >= 1
        r = httpx.post(url + "/clear_kv_storage", timeout=60)
        assert r.status_code == 200 and r.json() == {"cleared": True}
    assert not list(store.rglob("*.kv"))


@pytest.mark.slow  # seconds to tens of seconds alone; runs in `make test-all`
def test_a_second_server_hits_what_the_first_computed_in_redis(tiny_model_dir):
    prompt = RNG.integers(100, 40000, 130).tolist()
    with RedisServer() as redis:
        args = ["--model", str(tiny_model_dir), *ARGS, "--kv-storage", redis.url]
        with (
            running_server(*args, timeout=STARTUP_S) as a,
            running_server(*args, timeout=STARTUP_S) as b,
        ):
            turn(a, prompt)
            wait_written(a, len(prompt) // PAGE)
            out = turn(b, prompt[:-3] + [7, 8, 9])
            meta = out["meta_info"]
            assert meta["cached_tokens_by_tier"]["storage"] >= len(prompt) // PAGE * PAGE - PAGE
            assert meta["cached_tokens"] == meta["cached_tokens_by_tier"]["storage"]
            m = samples(b)
            assert m[("kv_storage_errors_total", ("kind", "read"))] == 0
            assert m[("kv_storage_prefetches_total",)] >= 1
