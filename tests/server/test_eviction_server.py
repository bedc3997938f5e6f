"""A real server with the ``reuse`` eviction policy: ``/metrics`` and ``/cache`` show what the
policy predicted for the leaves it evicted and how many of them came back."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testing.server import running_server

ADMIN = {"Authorization": "Bearer adm"}


def eviction_samples(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", headers=ADMIN).text):
        for s in family.samples:
            if s.name.startswith("radix_eviction_"):
                assert s.labels["policy"] == "reuse"
                out[s.name.removesuffix("_total")] = s.value
    return out


def test_metrics_and_cache_report_predicted_and_returned_evictions(tiny_model_dir):
    args = ("--model", str(tiny_model_dir), "--max-total-tokens", "512", "--admin-key", "adm",
            "--eviction-policy", "reuse", "--dtype", "float32")  # fmt: skip
    with running_server(*args) as url:
        prompts = [[1000 + 200 * i + t for t in range(150)] for i in range(5)]
        for ids in [*prompts, prompts[0]]:  # 5 x 150 tokens in a 512-token pool: evictions
            body = {"input_ids": ids, "sampling_params": {"max_tokens": 2}}
            r = httpx.post(url + "/generate", json=body, headers=ADMIN, timeout=120)
            assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["cached_tokens"] == 0  # the first prompt was evicted
        m = eviction_samples(url)
        assert m["radix_eviction_predicted_leaves"] >= 2
        assert 0 < m["radix_eviction_predicted_returns"] < m["radix_eviction_predicted_leaves"]
        assert m["radix_eviction_returned_leaves"] >= 1  # the first prompt came back
        assert m["radix_eviction_returned_tokens"] >= 150
        cache = httpx.get(url + "/cache", headers=ADMIN).json()
        e = cache["eviction"]
        assert (
            e["policy"] == "reuse" and e["evicted_leaves"] == m["radix_eviction_predicted_leaves"]
        )
        assert e["observed_return_rate"] == e["returned_leaves"] / e["evicted_leaves"]
        assert 0 < e["predicted_return_rate"] < 1
