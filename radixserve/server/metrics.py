"""Prometheus metrics for one server, in a registry of its own (servers may share a process).

Cache and pool figures come from the engine's stats snapshot (sent after every step) and are
exported as they are on each scrape, by a custom collector. Latencies are measured here, in
the HTTP process, from the moment a request arrives. The hit rate and average matched prefix
are over the requests admitted in the last ``WINDOW_SECONDS``. Token counters move as tokens
are generated, not when a request ends. ``engine_restarts`` reads the engine supervisor's
count on each scrape.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixserve.engine.stats import EngineInfo, EngineStats
from radixserve.server.eviction_metrics import eviction_families
from radixserve.server.tier_metrics import pin_families, tier_families

WINDOW_SECONDS = 60.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
EVICT_BUCKETS = (0, 1, 16, 64, 256, 1024, 4096, 16384, 65536)


class Metrics:
    def __init__(
        self, model_name: str, info: EngineInfo, engine_restarts: Callable[[], int] = lambda: 0
    ):
        self.model_name = model_name
        self.info = info
        self.engine_restarts = engine_restarts
        self.registry = CollectorRegistry()
        self.stats = EngineStats.idle(info.kv_capacity_tokens)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self._window: deque[tuple[float, int, int]] = deque()  # (time, prompt, cached)
        self.registry.register(self)
        h = dict(registry=self.registry, labelnames=["model_name"])
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, **h
        )
        self.itl = Histogram(
            "inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=LATENCY_BUCKETS,
            **h,
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, **h
        )
        self.evict_per_batch = Histogram(
            "radix_evict_count_per_batch",
            "Tokens evicted from the radix tree per engine step",
            buckets=EVICT_BUCKETS,
            **h,
        )

    # ------------------------------------------------------------------ updates
    def update_stats(self, stats: EngineStats, after_step: bool = False) -> None:
        self.stats = stats
        if after_step:
            self.evict_per_batch.labels(self.model_name).observe(stats.step_evicted_tokens)

    def on_admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        now = time.monotonic()
        self.prompt_tokens += prompt_tokens
        self._window.append((now, prompt_tokens, cached_tokens))
        while self._window and self._window[0][0] < now - WINDOW_SECONDS:
            self._window.popleft()

    def on_tokens(self, n: int) -> None:
        self.generation_tokens += n

    def on_rejected(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def on_finished(self, finish_reason: str | None, e2e: float) -> None:
        reason = finish_reason or "unknown"
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.e2e.labels(self.model_name).observe(e2e)

    def window_hit_rate(self) -> tuple[float, float]:
        """(hit rate, average matched prefix in tokens) over the recent window."""
        if not self._window:
            return 0.0, 0.0
        prompt = sum(p for _, p, _ in self._window)
        cached = sum(c for _, _, c in self._window)
        return (cached / prompt if prompt else 0.0), cached / len(self._window)

    # ------------------------------------------------------------------ export
    def collect(self):
        yield from self._cache_families()
        yield from self._request_families()
        yield from self._pool_families()
        yield from self._segment_families()
        yield from self._grammar_families()
        yield self._refused_family()
        yield from self._draft_families()
        yield from tier_families(self.stats, self.model_name)
        yield from pin_families(self.stats, self.model_name)
        yield from eviction_families(self.stats, self.model_name)

    def _cache_families(self):
        s, cache, m = self.stats, self.stats.cache, self.model_name
        hit_rate, avg_match = self.window_hit_rate()
        yield counter(m, "radix_cache_query_tokens", "Prompt tokens looked up in the radix cache",
                      cache.lookup_tokens)  # fmt: skip
        yield counter(m, "radix_cache_hit_tokens", "Prompt tokens served from the radix cache",
                      cache.hit_tokens)  # fmt: skip
        yield counter(m, "radix_evicted_tokens", "Tokens evicted from the radix cache",
                      cache.evicted_tokens)  # fmt: skip
        yield counter(m, "radix_retracted_requests", "Requests preempted for lack of KV slots",
                      s.num_retractions)  # fmt: skip
        window = f"over the last {WINDOW_SECONDS:.0f} s"
        yield gauge(m, "radix_cache_hit_rate", f"Cache hit rate {window}", hit_rate)
        yield gauge(m, "radix_avg_prefix_match_len",
                    f"Average matched prefix per admitted request {window}", avg_match)  # fmt: skip
        yield gauge(m, "radix_cache_cached_tokens", "Tokens held by the radix tree",
                    s.cached_tokens)  # fmt: skip

    def _request_families(self):
        m = self.model_name
        yield counter(m, "prompt_tokens", "Prompt tokens of admitted requests", self.prompt_tokens)
        yield counter(m, "generation_tokens", "Generated tokens", self.generation_tokens)
        finished = CounterMetricFamily(
            "requests_finished",
            "Finished requests by reason",
            labels=["model_name", "finish_reason"],
        )
        for reason, n in sorted(self.requests.items()):
            finished.add_metric([m, reason], n)
        yield finished
        rejected = CounterMetricFamily(
            "requests_rejected",
            "Requests refused for lack of room (503 with Retry-After), by reason",
            labels=["model_name", "reason"],
        )
        for reason, n in sorted(self.rejected.items()):
            rejected.add_metric([m, reason], n)
        yield rejected
        yield counter(m, "engine_restarts", "Times the engine process died and was started again",
                      self.engine_restarts())  # fmt: skip
        yield gauge(m, "num_running_reqs", "Requests in the running batch", self.stats.num_running)
        yield gauge(m, "num_queue_reqs", "Requests waiting for admission", self.stats.num_waiting)

    def _pool_families(self):
        s, m = self.stats, self.model_name
        yield gauge(m, "kv_cache_usage_ratio", "Share of KV slots not obtainable now", s.kv_usage)
        yield gauge(m, "kv_cache_used_tokens", "KV slots in use (held or cached)",
                    s.kv_used_tokens)  # fmt: skip
        yield gauge(m, "kv_cache_capacity_tokens", "KV pool size in slots", s.kv_capacity_tokens)
        yield gauge(m, "kv_cache_bytes_per_token", "KV bytes per slot (all layers, K and V)",
                    self.info.kv_bytes_per_token)  # fmt: skip
        w = s.window
        if w is not None:  # sliding-window layers with a pool of their own
            yield gauge(m, "window_kv_capacity_tokens", "Window-layer KV pool size in slots",
                        w.capacity_tokens)  # fmt: skip
            yield gauge(m, "window_kv_used_tokens", "Window-layer KV slots in use",
                        w.used_tokens)  # fmt: skip
            yield counter(m, "window_kv_tombstoned_tokens",
                          "Cached tokens whose window-layer KV was dropped",
                          w.tombstoned_tokens)  # fmt: skip

    def _segment_families(self):
        seg, m = self.stats.segments, self.model_name
        yield counter(m, "radix_segment_lookups", "RAG segments looked up", seg.lookups)
        yield counter(m, "radix_segment_hits", "RAG segments reused from the store", seg.hits)
        yield counter(m, "radix_segment_fills", "RAG segments computed and stored", seg.fills)
        yield counter(m, "radix_segment_reused_tokens",
                      "Prompt tokens whose KV came from stored segments",
                      seg.reused_tokens)  # fmt: skip
        yield counter(m, "radix_segment_recomputed_tokens", "Reused segment tokens computed again",
                      seg.recomputed_tokens)  # fmt: skip

    def _grammar_families(self):
        g, m = self.stats.grammar, self.model_name
        yield counter(m, "constrained_requests", "Requests with a grammar (structured output)",
                      g.constrained_requests)  # fmt: skip
        yield counter(m, "grammar_compiles", "Grammars compiled", g.compiles)
        yield counter(m, "grammar_cache_hits", "Grammars found compiled in the cache",
                      g.cache_hits)  # fmt: skip
        yield counter(m, "grammar_compile_seconds", "Time spent compiling grammars",
                      g.compile_seconds)  # fmt: skip
        backends = CounterMetricFamily(
            "grammar_backend_requests", "Constrained requests by the grammar engine enforcing "
            "them (xgrammar first, llguidance where xgrammar would not enforce the schema)",
            labels=["model_name", "backend"],
        )  # fmt: skip
        backends.add_metric([m, "xgrammar"], g.xgrammar_requests)
        backends.add_metric([m, "llguidance"], g.llguidance_requests)
        yield backends

    def _refused_family(self):
        """Connections the ZeroMQ sockets turned away (links/guard.py), by link and reason."""
        refused = CounterMetricFamily(
            "zmq_refused_connections",
            "ZeroMQ connections turned away: key (not allowed), protocol (not CurveZMQ with "
            "this server's key), handshake (cut short or stalled); and KV transfer messages "
            "refused on a sealed data connection: sealed (tampered, replayed or forged)",
            labels=["model_name", "link", "reason"],
        )
        transfer = self.stats.kv_transfer
        connections = ("key", "protocol", "handshake")
        by_link = {
            "kv_events": (self.stats.kv_events_refused, connections),
            "kv_transfer": (transfer.refused if transfer else {}, (*connections, "sealed")),
        }
        for link, (counts, reasons) in by_link.items():
            for reason in reasons:
                refused.add_metric([self.model_name, link, reason], counts.get(reason, 0))
        return refused

    def _draft_families(self):
        """Per draft source: steps that verified one of its drafts, draft tokens computed and
        kept, and output tokens per such step."""
        sources = self.stats.drafts.sources
        labels = ["model_name", "source"]
        steps = CounterMetricFamily("draft_steps", "Steps that verified a draft", labels=labels)
        proposed = CounterMetricFamily("draft_proposed_tokens",
                                       "Draft tokens computed (verified by the model)",
                                       labels=labels)  # fmt: skip
        accepted = CounterMetricFamily("draft_accepted_tokens",
                                       "Draft tokens kept: outputs without a step of their own",
                                       labels=labels)  # fmt: skip
        per_step = GaugeMetricFamily("draft_tokens_per_step",
                                     "Output tokens per step that verified a draft (kept + 1)",
                                     labels=labels)  # fmt: skip
        for name, s in sources.items():
            key = [self.model_name, name]
            steps.add_metric(key, s.steps)
            proposed.add_metric(key, s.proposed_tokens)
            accepted.add_metric(key, s.accepted_tokens)
            per_step.add_metric(key, s.tokens_per_step)
        yield from (steps, proposed, accepted, per_step)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def counter(model_name: str, name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["model_name"])
    c.add_metric([model_name], value)
    return c


def gauge(model_name: str, name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric([model_name], value)
    return g
