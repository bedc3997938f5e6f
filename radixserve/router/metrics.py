"""The router's Prometheus metrics, in a registry of its own.

Per worker: requests routed and the prefix tokens the policy predicted each would find cached.
Fleet-wide: prompt tokens, predicted cached tokens, the cached tokens workers reported, and
the confirmed part (per request ``min(predicted, reported)``), so that

    hit rate           = reported / prompt tokens
    routing precision  = confirmed / predicted

Load imbalance is max / mean over workers of requests in flight, and of requests routed so
far. Routing latency is the policy's decision alone; preparation is tokenizing and hashing.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from radixserve.router.policy import Policy

ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


def _imbalance(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


class RouterMetrics:
    def __init__(self, policy: Policy):
        self.policy = policy
        self.registry = CollectorRegistry()
        r = dict(registry=self.registry)
        self.requests = Counter("radix_router_requests", "Requests routed", ["worker"], **r)
        self.prefix_tokens = Counter(
            "radix_router_routed_prefix_tokens",
            "Prompt tokens predicted cached on the worker a request was routed to",
            ["worker"],
            **r,
        )
        self.prompt_tokens = Counter("radix_router_prompt_tokens", "Prompt tokens routed", **r)
        self.reported = Counter(
            "radix_router_reported_cached_tokens", "Cached prompt tokens workers reported", **r
        )
        self.confirmed = Counter(
            "radix_router_confirmed_cached_tokens",
            "Per request min(predicted, reported) cached tokens",
            **r,
        )
        self.retries = Counter("radix_router_retries", "Requests retried on another worker", **r)
        self.failures = Counter("radix_router_failures", "Requests no worker could serve", **r)
        self.routing = Histogram(
            "radix_router_routing_seconds", "Policy decision time", buckets=ROUTING_BUCKETS, **r
        )
        self.prepare = Histogram(
            "radix_router_prepare_seconds",
            "Tokenizing and hashing a request",
            buckets=ROUTING_BUCKETS,
            **r,
        )
        self.routed: dict[str, int] = {}
        self.registry.register(self)

    def on_route(self, worker: str, prompt_tokens: int, predicted: int) -> None:
        self.requests.labels(worker).inc()
        self.prefix_tokens.labels(worker).inc(predicted)
        self.prompt_tokens.inc(prompt_tokens)
        self.routed[worker] = self.routed.get(worker, 0) + 1

    def on_finish(self, predicted: int, reported: int | None) -> None:
        if reported is not None:
            self.reported.inc(reported)
            self.confirmed.inc(min(predicted, reported))

    def collect(self):
        board = self.policy.board
        running = GaugeMetricFamily(
            "radix_router_worker_running", "Requests in flight per worker", labels=["worker"]
        )
        for worker, n in board.running.items():
            running.add_metric([worker], n)
        yield running
        yield GaugeMetricFamily(
            "radix_router_load_imbalance",
            "max / mean requests in flight over workers",
            value=_imbalance([float(n) for n in board.running.values()]),
        )
        routed = [float(self.routed.get(w, 0)) for w in self.policy.workers]
        yield GaugeMetricFamily(
            "radix_router_requests_imbalance",
            "max / mean requests routed over workers",
            value=_imbalance(routed),
        )
        index = getattr(self.policy, "index", None)
        if index is not None:
            exact, approx = index.size()
            entries = GaugeMetricFamily(
                "radix_router_index_entries", "Block index entries", labels=["kind"]
            )
            entries.add_metric(["exact"], exact)
            entries.add_metric(["approximate"], approx)
            yield entries

    def render(self) -> bytes:
        return generate_latest(self.registry)
