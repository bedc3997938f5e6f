"""The load generator: replay a workload against one OpenAI-compatible server.

Method, in order:

1. ``check_server``: ``/health`` and ``/v1/models`` with a short timeout (a dead or refusing
   server fails here, in seconds).
2. Warm-up: ``warmup_requests`` short prompts of random words, sharing nothing with the
   workload, not counted. A failing warm-up ends the run with its error: a server that cannot
   answer a short prompt cannot be measured.
3. ``POST /flush_cache`` (when ``flush_cache``; servers without it are recorded as not flushed),
   so every system starts the measured phase from an empty prefix cache.
4. The measured phase. Conversations arrive in workload order: all at once (``request_rate``
   infinite, a closed loop) or as a Poisson process of ``request_rate`` conversation starts per
   second (an open loop; seeded). At most ``max_concurrency`` conversations are in flight, so
   at most that many requests. A conversation sends turn k+1 only once turn k's answer has
   arrived, with the streamed answer appended to the history as the assistant message, after
   a think time (``think_time``: exponential with that mean, drawn from the seed and the
   conversation's id, so every system sees the same pauses; a thinking conversation keeps its
   place among the ``max_concurrency``); a failed turn ends its conversation. No request
   starts after ``max_requests`` were started or ``duration`` seconds passed; every request is
   cut at ``request_timeout`` seconds, so a run always ends.
5. Meanwhile ``/metrics`` is scraped every ``metrics_interval`` seconds (when the server has it).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench import client as api_client
from radixserve.bench.client import BenchError, RequestRecord
from radixserve.bench.workloads import Conversation, Workload, words

WARMUP_WORDS = 16
WARMUP_MAX_TOKENS = 4


@dataclass
class LoadConfig:
    base_url: str
    request_rate: float = math.inf  # conversation starts per second; inf: all at once
    max_concurrency: int = 4
    think_time: float = 0.0  # mean seconds between an answer and the next turn; 0: none
    max_requests: int | None = None
    duration: float | None = None  # seconds; no request starts after it
    request_timeout: float = 300.0
    warmup_requests: int = 2
    temperature: float = 0.0
    # sent with every request where given (a radixserve extension: 1.0 turns off the penalty a
    # model's generation config may set, and a penalised request never drafts)
    repetition_penalty: float | None = None
    seed: int = 0
    api_key: str | None = None
    metrics_interval: float = 1.0  # 0: do not scrape
    flush_cache: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://: {self.base_url!r}")
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf: all at once), got {self.request_rate}"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 0 <= self.think_time < math.inf:
            raise ValueError(f"think_time must be >= 0 seconds, got {self.think_time}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        for name in ("duration", "request_timeout"):
            value = getattr(self, name)
            if value is not None and not (0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        rp = self.repetition_penalty
        if rp is not None and not 0 < rp <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {rp}")
        if self.metrics_interval < 0:
            raise ValueError(f"metrics_interval must be >= 0, got {self.metrics_interval}")


@dataclass
class RunResult:
    model: str
    records: list[RequestRecord]
    duration_s: float  # measured phase: first start to last finish
    metrics: list[dict[str, float]] = field(default_factory=list)  # {"t": s, name: value}
    metrics_available: bool = False
    cache_flushed: bool = False


class _Budget:
    """Who may start a request: at most ``max_requests`` of them, none after the deadline."""

    def __init__(self, max_requests: int | None, duration: float | None):
        self.left = math.inf if max_requests is None else max_requests
        self.deadline = math.inf if duration is None else time.perf_counter() + duration

    def open(self) -> bool:
        return self.left > 0 and time.perf_counter() < self.deadline

    def take(self) -> bool:
        if not self.open():
            return False
        self.left -= 1
        return True


def run_load(workload: Workload, config: LoadConfig, label: str = "") -> RunResult:
    """Run ``workload`` against ``config.base_url``; raise ``BenchError`` if it cannot start."""
    if workload.api == "completions" and any(len(c.user_turns) > 1 for c in workload.conversations):
        raise ValueError("a completions workload has one turn per conversation")
    return asyncio.run(_run(workload, config, label))


async def _run(workload: Workload, config: LoadConfig, label: str) -> RunResult:
    limits = httpx.Limits(max_connections=config.max_concurrency + 4)
    timeout = httpx.Timeout(config.request_timeout, connect=api_client.HEALTH_TIMEOUT_S)
    headers = api_client.auth_headers(config.api_key)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        model = await api_client.check_server(client, config.base_url)
        runner = _Runner(client, workload, config, model)
        await runner.warm_up()
        flushed = config.flush_cache and await api_client.flush_cache(client, config.base_url)
        return await runner.measure(label, flushed)


class _Runner:
    def __init__(
        self, client: httpx.AsyncClient, workload: Workload, config: LoadConfig, model: str
    ):
        self.client, self.workload, self.config, self.model = client, workload, config, model
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()

    async def send(self, record: RequestRecord, content: Any, max_tokens: int) -> str:
        """One request, cut at ``request_timeout``; fills ``record``, returns the answer."""
        body = api_client.request_body(
            self.workload.api, self.model, content, max_tokens, self.config.temperature
        )
        if self.config.repetition_penalty is not None:
            body["repetition_penalty"] = self.config.repetition_penalty
        try:
            async with asyncio.timeout(self.config.request_timeout):
                return await api_client.stream_request(
                    self.client, self.config.base_url, self.workload.api, body, record
                )
        except TimeoutError:
            record.success = False
            record.error = f"no complete answer within {self.config.request_timeout:g} s"
            return ""

    async def warm_up(self) -> None:
        rng = random.Random(f"warmup-{self.config.seed}")
        sem = asyncio.Semaphore(self.config.max_concurrency)

        async def one(i: int) -> RequestRecord:
            prompt = words(rng, WARMUP_WORDS)
            chat = self.workload.api == "chat"
            record = RequestRecord(f"warmup-{i}", 1, 0.0)
            async with sem:
                await self.send(
                    record, [{"role": "user", "content": prompt}] if chat else prompt,
                    WARMUP_MAX_TOKENS,
                )  # fmt: skip
            return record

        for record in await asyncio.gather(*(one(i) for i in range(self.config.warmup_requests))):
            if not record.success:
                raise BenchError(
                    f"warm-up request to {self.config.base_url} failed: {record.error}"
                )

    async def measure(self, label: str, flushed: bool) -> RunResult:
        config = self.config
        total = self.workload.num_requests
        if config.max_requests is not None:
            total = min(total, config.max_requests)
        self.t0 = time.perf_counter()
        budget = _Budget(config.max_requests, config.duration)
        sem = asyncio.Semaphore(config.max_concurrency)
        rng = random.Random(config.seed)
        stop = asyncio.Event()
        samples: list[dict[str, float]] = []
        scraper = asyncio.create_task(self.scrape(samples, stop))
        bar = tqdm(
            total=total, desc=label or self.workload.name, unit="req", disable=not config.progress
        )

        async def converse(conversation: Conversation) -> None:
            async with sem:
                await self.conversation(conversation, budget, bar)

        tasks = []
        try:
            for conversation in self.workload.conversations:
                if tasks and config.request_rate < math.inf:
                    await asyncio.sleep(rng.expovariate(config.request_rate))
                if not budget.open():
                    break
                tasks.append(asyncio.create_task(converse(conversation)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            stop.set()
            available = await scraper
            bar.close()
        ends = [r.end_time for r in self.records if r.end_time is not None]
        duration = max(ends, default=time.perf_counter() - self.t0)
        return RunResult(self.model, self.records, duration, samples, available, flushed)

    async def conversation(self, conversation: Conversation, budget: _Budget, bar: tqdm) -> None:
        history: list[dict[str, str]] = []
        if conversation.system is not None:
            history.append({"role": "system", "content": conversation.system})
        pauses = random.Random(f"{self.config.seed}:{conversation.id}")
        for turn, user in enumerate(conversation.user_turns, 1):
            if turn > 1 and self.config.think_time > 0:
                await asyncio.sleep(pauses.expovariate(1 / self.config.think_time))
            if not budget.take():
                return
            history.append({"role": "user", "content": user})
            content = list(history) if self.workload.api == "chat" else user
            record = RequestRecord(conversation.id, turn, time.perf_counter() - self.t0)
            answer = await self.send(record, content, self.workload.max_tokens)
            self.records.append(record)
            bar.update(1)
            if not record.success:
                return
            history.append({"role": "assistant", "content": answer})

    async def scrape(self, samples: list[dict[str, float]], stop: asyncio.Event) -> bool:
        """Poll ``/metrics`` until ``stop``, once more after it (cached KV peaks at the end).

        Returns False if the server has no metrics endpoint.
        """
        interval = self.config.metrics_interval
        if interval <= 0:
            return False
        url = f"{self.config.base_url}/metrics"
        while True:
            try:
                r = await self.client.get(url, timeout=max(interval, 1.0) * 5)
            except httpx.HTTPError:
                r = None  # a missed scrape is a gap in the series, not an error
            if r is not None and r.status_code != 200 and not samples:
                return False
            if r is not None and r.status_code == 200:
                t = time.perf_counter() - self.t0
                samples.append({"t": t, **api_client.parse_metrics(r.text)})
            if stop.is_set():
                return bool(samples)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass
