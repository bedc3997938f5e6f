"""Ray Serve: a Serve application whose replicas are radixserve engines, routed by our policy.

Ray handles placement, autoscaling, health and multi-node; we bring the engine and the
routing. Two deployments:

- ``RadixServeReplica``: one engine process per replica behind the server's own FastAPI app
  (``server.app.create_app``, called in-process over ASGI), so a replica answers exactly like
  ``radixserve serve``. It publishes KV events and reports where in its routing stats.
- ``RadixServeIngress``: the HTTP entry. It tokenizes and hashes a request like ``radixserve
  router`` (``router.prompts``) and calls a replica through a deployment handle, passing the
  block hashes as ``route=``; the response streams back untouched, with the replica's id in
  the ``x-radixserve-worker`` header.

``CacheAwareRequestRouter`` is the replicas' request router (Ray Serve's custom request router
API, ``ray.serve.request_router.RequestRouter``, Ray 2.60): it keeps one ``policy.Policy``
whose workers are replica ids, subscribes to every replica's KV events (endpoints from the
routing stats), and ranks the chosen replica first. Tickets are finished when Ray reports the
request completed (or when Ray routed it elsewhere).
"""

# No ``from __future__ import annotations``: Serve's ingress hands FastAPI the methods'
# signatures as they are, and FastAPI must see ``Request`` itself, not the string "Request".
import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.kvevents.subscriber import EventSubscriber
from radixserve.router.policy import Policy, PolicyConfig, Route, RouteRequest, make_policy

WORKER_HEADER = "x-radixserve-worker"


class CacheAwareRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "cache-aware", **config: Any) -> None:
        self.policy: Policy = make_policy(policy, PolicyConfig(**config))
        self._routes: dict[str, Route] = {}
        self._subscriptions: dict[str, asyncio.Task] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for worker in [w for w in self.policy.workers if w not in live]:
            self.policy.remove_worker(worker)
            task = self._subscriptions.pop(worker, None)
            if task is not None:
                task.cancel()
        for worker in live:
            self.policy.add_worker(worker)

    def _subscribe(self, replica: RunningReplica) -> None:
        worker = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        if worker in self._subscriptions or not stats.get("kv_events_endpoint"):
            return
        sub = EventSubscriber(
            stats["kv_events_endpoint"],
            stats.get("kv_events_replay_endpoint"),
            on_events=lambda events: self.policy.apply_events(worker, events),
            on_reset=lambda: self.policy.worker_lost_events(worker),
        )
        self._subscriptions[worker] = asyncio.get_running_loop().create_task(sub.run())
        getattr(self.policy, "set_has_events", lambda *_: None)(worker, True)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        for replica in candidate_replicas:
            self._subscribe(replica)
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for worker in by_id:
            self.policy.add_worker(worker)
        hints = pending_request.kwargs.get("route") or {}
        request = RouteRequest(
            hints.get("block_hashes", ()), hints.get("num_tokens", 0), hints.get("session_key")
        )
        request_id = pending_request.metadata.internal_request_id
        self._finish(request_id)  # a retry of this request: its earlier choice is void
        exclude = [w for w in self.policy.workers if w not in by_id]
        route = self.policy.route(request, time.monotonic(), exclude)
        self._routes[request_id] = route
        chosen = by_id[route.worker]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def _finish(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None:
            self.policy.finish(route.ticket, now=time.monotonic())

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        route = self._routes.get(pending_request.metadata.internal_request_id)
        if route is not None and route.worker != replica_id.unique_id:
            self._finish(pending_request.metadata.internal_request_id)  # Ray went elsewhere

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._finish(internal_request_id)


@serve.deployment
class RadixServeReplica:
    async def __init__(self, engine_options: dict[str, Any], served_model_name: str | None):
        import ray

        from radixserve.api.config import ServerConfig
        from radixserve.config import EngineConfig
        from radixserve.model.generation_defaults import generation_defaults
        from radixserve.model.loader import resolve_model_path
        from radixserve.model.tokenizer import Tokenizer
        from radixserve.server.app import create_app
        from radixserve.server.engine_client import EngineClient

        host = ray.util.get_node_ip_address()
        config = EngineConfig.from_options(
            **engine_options,
            kv_events_endpoint=f"tcp://{host}:0",
            kv_events_replay_endpoint=f"tcp://{host}:0",
        )
        self.client = EngineClient(config, on_stats=lambda *_: None)
        info = await self.client.start()
        path = resolve_model_path(config.model)
        tokenizer = await asyncio.to_thread(Tokenizer.from_model_path, path, [])
        server_config = ServerConfig(served_model_name=served_model_name or info.model_name)
        sampling = generation_defaults(path)
        self.app = create_app(self.client, tokenizer, server_config, sampling)
        self.info = info
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def record_routing_stats(self) -> dict[str, Any]:
        return {
            "kv_events_endpoint": self.info.kv_events_endpoint,
            "kv_events_replay_endpoint": self.info.kv_events_replay_endpoint,
        }

    async def handle(
        self, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]], route=None
    ) -> AsyncIterator[Any]:
        """Run one HTTP request through the server app; yield (status, headers), then bytes."""
        queue: asyncio.Queue = asyncio.Queue()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": headers, "scheme": "http", "server": ("replica", 0),
                 "client": ("ingress", 0), "root_path": ""}  # fmt: skip
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves on its own here
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await queue.put(message)

        task = asyncio.create_task(self.app(scope, receive, send))
        try:
            while True:
                message = await queue.get()
                if message["type"] == "http.response.start":
                    extra = [(WORKER_HEADER.encode(), self.replica_id.encode())]
                    yield message["status"], [*message.get("headers", []), *extra]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
        finally:
            task.cancel()

    async def __del__(self):
        await self.client.close()


def _ingress_app():
    app = FastAPI(title="radixserve on Ray Serve")

    @serve.deployment
    @serve.ingress(app)
    class RadixServeIngress:
        def __init__(self, replicas: Any, model: str | None, block_size: int):
            from radixserve.model.loader import resolve_model_path
            from radixserve.model.tokenizer import Tokenizer

            self.replicas = replicas
            self.tokenizer = Tokenizer.from_model_path(resolve_model_path(model), [])
            self.block_size = block_size

        @app.get("/health")
        async def health(self) -> dict:
            return {"status": "ok"}

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(self, path: str, request: Request) -> StreamingResponse:
            from radixserve.api.errors import ApiError
            from radixserve.router.prompts import parse_body, route_request

            raw = await request.body()
            path = "/" + path
            try:
                body = parse_body(raw)
            except ApiError:
                body = None  # the replica answers with its own 400 (or it is a GET)
            wanted = route_request(path, body, dict(request.headers), self.tokenizer,
                                   self.block_size)  # fmt: skip
            hints = {"block_hashes": list(wanted.block_hashes), "num_tokens": wanted.num_tokens,
                     "session_key": wanted.session_key}  # fmt: skip
            headers = [(k.encode(), v.encode()) for k, v in request.headers.items()
                       if k.lower() not in ("host", "content-length")]  # fmt: skip
            headers.append((b"content-length", str(len(raw)).encode()))
            stream = self.replicas.options(stream=True).handle.remote(
                request.method, path, raw, headers, route=hints
            )
            status, out_headers = await stream.__anext__()

            async def body() -> AsyncIterator[bytes]:
                async for chunk in stream:
                    yield chunk

            keep = {k.decode(): v.decode() for k, v in out_headers
                    if k.decode().lower() in ("content-type", WORKER_HEADER)}  # fmt: skip
            return StreamingResponse(body(), status_code=status, headers=keep)

    return RadixServeIngress


def build_app(
    engine_options: dict[str, Any],
    replicas: int = 2,
    policy: str = "cache-aware",
    policy_config: dict[str, Any] | None = None,
    served_model_name: str | None = None,
    replica_cpus: float = 1.0,
    stats_period_s: float = 1.0,
):
    """The Serve application: ``replicas`` engines behind the ingress, routed by ``policy``."""
    from ray.serve.config import RequestRouterConfig

    from radixserve.kvevents.hashing import default_block_size

    block = engine_options.get("kv_events_block_size") or default_block_size(
        engine_options.get("page_size") or 1
    )
    router_config = RequestRouterConfig(
        request_router_class=CacheAwareRequestRouter,
        request_router_kwargs={"policy": policy, **(policy_config or {}), "block_size": block},
        request_routing_stats_period_s=stats_period_s,
    )
    engines = RadixServeReplica.options(
        num_replicas=replicas,
        request_router_config=router_config,
        ray_actor_options={"num_cpus": replica_cpus},
        max_ongoing_requests=1000,
    ).bind(engine_options, served_model_name)
    ingress = _ingress_app().options(ray_actor_options={"num_cpus": 0})
    return ingress.bind(engines, engine_options.get("model"), block)
