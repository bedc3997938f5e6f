"""The router's workers: registration, health checks and KV-event subscriptions (asyncio).

A worker is a radixserve (or any OpenAI-compatible) server's base URL. Adding one asks it for
its model (``/v1/models``) and its KV-event endpoints (``/kv_events``; a server without them
is routed with approximate entries only). Its events feed the policy's index through an
``EventSubscriber``; an endpoint bound to a wildcard address is reached at the worker's host.
The subscriber uses the router's ZeroMQ keys and expects the server key the worker's
``/kv_events`` names (``curve_public_key``); a worker whose sockets are plain joins only a
router that reads plain sockets (``--zmq-unauthenticated``), and the other way round.

Health: every ``health_interval`` seconds each worker's ``/health`` is polled; after
``max_failures`` failures in a row (or a request that could not reach it) the worker leaves
the policy (its index entries are dropped and no request goes to it) until it answers again;
requests still waiting for its first bytes are retried elsewhere (``Worker.down``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from radixserve.kvevents.subscriber import EventSubscriber
from radixserve.links.keys import ZmqSecurity, check_key
from radixserve.router.policy import Policy

log = logging.getLogger("radixserve")


class WorkerError(ValueError):
    """A worker cannot join the fleet (unreachable, another model, another block size)."""


@dataclass
class Worker:
    url: str
    model: str
    block_size: int | None  # KV event block size; None: no events
    events: dict[str, Any] = field(default_factory=dict)
    healthy: bool = True
    failures: int = 0
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while out of the fleet
    task: asyncio.Task | None = None
    subscriber: EventSubscriber | None = None

    def describe(self, policy: Policy) -> dict[str, Any]:
        board = policy.board
        return {
            "url": self.url,
            "healthy": self.healthy,
            "kv_events": self.events or None,
            "running": board.running.get(self.url, 0),
            "load": board.load(self.url) if self.url in board else None,
        }


def _reachable(endpoint: str, worker_url: str) -> str:
    """An endpoint bound to all interfaces, as seen from here: at the worker's host."""
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard) :]}"
    return endpoint


def _key(events: dict[str, Any]) -> bytes | None:
    key = events.get("curve_public_key")
    return key.encode() if key else None


class WorkerPool:
    def __init__(
        self,
        policy: Policy,
        client: httpx.AsyncClient,
        security: ZmqSecurity,
        health_interval: float = 2.0,
        max_failures: int = 2,
    ):
        self.policy, self.client = policy, client
        self.security = security
        self.health_interval, self.max_failures = health_interval, max_failures
        self.workers: dict[str, Worker] = {}
        self.model: str | None = None
        self.block_size = policy.config.block_size  # the router hashes prompts in these
        self._health_task: asyncio.Task | None = None

    async def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise WorkerError(f"a worker URL starts with http:// or https://, got {url!r}")
        if url in self.workers:
            return self.workers[url]
        try:
            models = await self.client.get(f"{url}/v1/models", timeout=10)
            models.raise_for_status()
            model = str(models.json()["data"][0]["id"])
            info = await self.client.get(f"{url}/kv_events", timeout=10)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise WorkerError(f"cannot add worker {url}: {type(e).__name__}: {e}") from e
        if self.model is not None and model != self.model:
            raise WorkerError(f"worker {url} serves {model!r}, the fleet serves {self.model!r}")
        events = info.json() if info.status_code == 200 else {}
        block = events.get("block_size") if events.get("endpoint") else None
        if block is not None:
            self._check_security(url, events)
        if block is not None and block != self.block_size:
            raise WorkerError(
                f"worker {url} names KV blocks of {block} tokens but the router hashes "
                f"{self.block_size}-token blocks: start the router with --block-size {block}"
            )
        self.model = model
        worker = Worker(url, model, block, events)
        self.workers[url] = worker
        self._join(worker)
        log.info("worker %s joined (%s)", url, "KV events" if block else "no KV events")
        return worker

    def _check_security(self, url: str, events: dict[str, Any]) -> None:
        """``WorkerError`` unless the worker's KV-event sockets and the router's keys agree
        on CurveZMQ or on plain sockets."""
        key = events.get("curve_public_key")
        if key is not None:
            try:
                check_key(key, f"worker {url}: curve_public_key")
            except ValueError as e:
                raise WorkerError(str(e)) from e
        if (key is None) != (self.security.public_key is None):
            theirs = "CurveZMQ" if key else "plain (--zmq-unauthenticated)"
            ours = "CurveZMQ keys" if self.security.public_key else "--zmq-unauthenticated"
            raise WorkerError(
                f"worker {url} publishes KV events on {theirs} sockets but this router runs "
                f"with {ours}: give both the same ZeroMQ setting"
            )

    def _join(self, worker: Worker) -> None:
        self.policy.add_worker(worker.url, has_events=worker.block_size is not None)
        self._subscribe(worker)

    def _subscribe(self, worker: Worker) -> None:
        if worker.block_size is not None and worker.task is None:
            url = worker.url
            worker.subscriber = EventSubscriber(
                _reachable(worker.events["endpoint"], url),
                _reachable(worker.events["replay_endpoint"], url)
                if worker.events.get("replay_endpoint")
                else None,
                on_events=lambda events: self.policy.apply_events(url, events),
                on_reset=lambda: self.policy.worker_lost_events(url),
                security=self.security,
                server_key=_key(worker.events),
            )
            worker.task = asyncio.create_task(self._follow(worker))

    async def _follow(self, worker: Worker) -> None:
        while True:
            try:
                await worker.subscriber.run()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a broken stream: forget what it said, then resync
                log.warning("KV events of %s: %s; resubscribing", worker.url, e)
                self.policy.worker_lost_events(worker.url)
                await asyncio.sleep(1.0)

    async def remove(self, url: str) -> bool:
        worker = self.workers.pop(url.rstrip("/"), None)
        if worker is None:
            return False
        worker.down.set()
        self._leave(worker)
        return True

    def _leave(self, worker: Worker) -> None:
        if worker.task is not None:
            worker.task.cancel()
            worker.task = None
        self.policy.remove_worker(worker.url)

    def mark_failed(self, url: str) -> None:
        """A request could not reach ``url``: take it out until a health check passes."""
        worker = self.workers.get(url)
        if worker is not None and worker.healthy:
            worker.healthy, worker.failures = False, self.max_failures
            worker.down.set()  # requests still waiting for its first bytes go elsewhere
            self._leave(worker)
            log.warning("worker %s is unreachable; routing around it", url)

    async def responds(self, worker: Worker) -> bool:
        """Whether ``worker`` answers its health probe now (within 2 s)."""
        try:
            return (await self.client.get(f"{worker.url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def check(self, worker: Worker) -> None:
        ok = await self.responds(worker)
        worker.failures = 0 if ok else worker.failures + 1
        if ok and worker.block_size is not None:
            await self._refresh_events(worker)
        if ok and not worker.healthy:
            worker.healthy = True
            worker.down.clear()
            self._join(worker)
            log.info("worker %s is healthy again", worker.url)
        elif not ok and worker.healthy and worker.failures >= self.max_failures:
            self.mark_failed(worker.url)

    async def _refresh_events(self, worker: Worker) -> None:
        """A restarted engine may publish elsewhere (port 0) or with another key: follow it."""
        try:
            r = await self.client.get(f"{worker.url}/kv_events", timeout=2.0)
            events = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return
        moved = ("endpoint", "replay_endpoint", "curve_public_key")
        if events and any(events.get(k) != worker.events.get(k) for k in moved):
            try:
                self._check_security(worker.url, events)
            except WorkerError as e:
                log.warning("%s; its KV events are not followed", e)
                return
            log.info("worker %s now publishes KV events at %s", worker.url, events["endpoint"])
            worker.events = events
            if worker.healthy and worker.task is not None:
                worker.task.cancel()
                worker.task = None
                self.policy.worker_lost_events(worker.url)
                self._subscribe(worker)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    def start(self) -> None:
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        tasks = [w.task for w in self.workers.values() if w.task is not None]
        if self._health_task is not None:
            tasks.append(self._health_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def healthy_urls(self) -> list[str]:
        return [w.url for w in self.workers.values() if w.healthy]
