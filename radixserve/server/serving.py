"""Running HTTP requests through the engine: fan-out to sub-requests, streaming, aborts.

One HTTP request becomes one engine request per (prompt, choice) pair (``n`` choices of
several prompts). Their outputs share one queue; ``OutputTracker`` turns them into text and
applies stop strings (which abort the engine request). If the client goes away, every
unfinished sub-request is aborted, so its locks and slots are released at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request

from radixserve.engine import SamplingParams
from radixserve.engine.output import OutputTracker
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.engine_client import EngineClient
from radixserve.server.metrics import Metrics
from radixserve.server.protocol import ApiError

DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class Job:
    """The engine requests behind one HTTP request, and their trackers (one per choice)."""

    kind: str  # response id prefix: chatcmpl, cmpl, gen
    prompts: list[list[int]]  # token ids per sub-request
    trackers: list[OutputTracker]
    request_ids: list[str]
    arrival: float = field(default_factory=time.monotonic)
    response_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def finished(self) -> bool:
        return all(t.finished for t in self.trackers)


class Serving:
    def __init__(self, client: EngineClient, tokenizer: Tokenizer, metrics: Metrics):
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics

    async def submit(
        self,
        kind: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        prefill_peer: str | None = None,
    ) -> tuple[Job, asyncio.Queue]:
        base = uuid.uuid4().hex[:24]
        job = Job(
            kind=kind, prompts=prompts, trackers=[], request_ids=[], response_id=f"{kind}-{base}"
        )
        queue: asyncio.Queue = asyncio.Queue()
        try:
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
                rid = f"{base}-{i}"
                job.trackers.append(OutputTracker(rid, self.tokenizer, p))
                job.request_ids.append(rid)
                await self.client.add(rid, ids, p, queue, tag=i, prefill_peer=prefill_peer)
        except ValueError as e:
            await self.abort_unfinished(job)
            raise ApiError(400, str(e)) from e
        return job, queue

    async def abort_unfinished(self, job: Job) -> None:
        for rid, tracker in zip(job.request_ids, job.trackers, strict=False):
            if not tracker.finished:
                await self.client.abort(rid)

    async def events(self, job: Job, queue: asyncio.Queue) -> AsyncIterator[int]:
        """Yield the index of each sub-request as its tracker changes, until all finish."""
        last_token_at: dict[int, float] = {}
        while not job.finished:
            tag, out = await queue.get()
            if isinstance(out, Exception):
                raise ApiError(503, str(out), kind="server_error")
            tracker = job.trackers[tag]
            if tracker.finished:
                continue  # the engine's answer to our own abort after a stop string
            now = time.monotonic()
            if out.new_token_ids:
                if tag not in last_token_at:
                    self.metrics.ttft.labels(self.metrics.model_name).observe(now - job.arrival)
                    self.metrics.on_admitted(out.prompt_tokens, out.cached_tokens)
                else:
                    self.metrics.itl.labels(self.metrics.model_name).observe(
                        now - last_token_at[tag]
                    )
                last_token_at[tag] = now
            if tracker.update(out):
                await self.client.abort(job.request_ids[tag], reason="stop")
            if tracker.finished:
                self.metrics.on_finished(
                    tracker.finish_reason, len(tracker.token_ids), now - job.arrival
                )
            yield tag

    async def wait(self, job: Job, queue: asyncio.Queue, raw: Request) -> Job:
        """Run a non-streaming job to the end; abort it if the client disconnects first."""

        async def drain():
            async for _ in self.events(job, queue):
                pass

        task = asyncio.create_task(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if not task.done() and await raw.is_disconnected():
                    break  # nobody to answer: the finally clause aborts the rest
            if task.done():
                task.result()  # re-raise what went wrong, e.g. a dead engine
            return job
        finally:
            if not task.done():
                task.cancel()
            await self.abort_unfinished(job)

    async def stream(
        self,
        job: Job,
        queue: asyncio.Queue,
        chunks: Callable[[Job, int], list[dict]],
        final: Callable[[Job], list[dict]],
    ) -> AsyncIterator[str]:
        """Server-sent events: ``chunks(job, index)`` after each change, ``final(job)`` last.
        A client that disconnects cancels this generator; its sub-requests are aborted."""
        try:
            async for tag in self.events(job, queue):
                for chunk in chunks(job, tag):
                    yield f"data: {json.dumps(chunk)}\n\n"
            for chunk in final(job):
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await self.abort_unfinished(job)
