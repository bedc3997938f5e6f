"""Running HTTP requests through the engine: fan-out to sub-requests, streaming, aborts.

One HTTP request becomes one engine request per (prompt, choice) pair (``n`` choices of
several prompts), all sent in one message: the engine reads them between the same two steps
and takes all or none (``engine_client.py``). Their outputs share one queue;
``OutputTracker`` turns them into text and applies stop strings (which abort the engine
request). If the client goes away, streaming or not, every unfinished sub-request is
aborted, so its locks and slots are released at once.

Admission: at most ``max_request_sequences`` sub-requests per request (400 beyond), and at
most ``max_queued_requests`` waiting beyond the engine's running batch (503 with
``Retry-After`` beyond). Tokenization and chat templates run on a worker thread (the
tokenizer releases the GIL), so a huge prompt never stalls ``/health`` or other requests.
A sub-request that ends with ``finish_reason="error"`` (the engine failed on it) or whose
engine died fails its HTTP request with a short message; the traceback is in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from radixserve.api.answers import AnswerMemory
from radixserve.api.config import ServerConfig
from radixserve.api.errors import ApiError, internal_error, unavailable
from radixserve.engine import SamplingParams
from radixserve.engine.output import OutputTracker
from radixserve.engine.spec import RequestSpec
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.engine_client import EngineClient, EngineDeadError
from radixserve.server.metrics import Metrics

DISCONNECT_POLL_SECONDS = 0.2
# a stream that has had nothing to say for this long (a long prompt still being prefilled)
# says so: agents drop a stream that stays silent, as Claude Code does after a few minutes
KEEPALIVE_SECONDS = 10.0
KEEPALIVE_COMMENT = ": keepalive\n\n"  # an SSE comment: every client skips it
ENGINE_ERROR = "the engine failed while computing this request; the details are in the server log"

log = logging.getLogger("radixserve.server")
T = TypeVar("T")


@dataclass(frozen=True)
class Wire:
    """How a stream's events are written: OpenAI's ``data:`` lines ending in ``[DONE]``, or
    (``named``) events named by their ``type``, as the Messages and Responses APIs send
    them; ``error`` is the event a failure becomes."""

    named: bool = False
    done: str = "data: [DONE]\n\n"
    error: Callable[[ApiError], dict] = ApiError.body

    def event(self, chunk: dict) -> str:
        data = json.dumps(chunk)
        return f"event: {chunk['type']}\ndata: {data}\n\n" if self.named else f"data: {data}\n\n"


OPENAI_WIRE = Wire()


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
    on_finish: Callable[[OutputTracker], None] | None = None  # as a choice ends well

    @property
    def finished(self) -> bool:
        return all(t.finished for t in self.trackers)


class Serving:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Tokenizer,
        metrics: Metrics,
        config: ServerConfig,
        max_running: int,
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.config = config
        self.max_running = max_running
        # one thread: a transformers tokenizer is not safe to share between threads
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenize")
        # grammar and tool-schema checks apart, so a large schema delays no one's tokenizing
        self._check_pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-check")
        self.answers = AnswerMemory()  # the answers given with tools, as the model wrote them

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work on the worker thread; its ``ValueError`` becomes a 400."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    async def checked(self, fn: Callable[[], T]) -> T:
        """Run a request's output-constraint checks (its grammar, its tools' schemas: up to
        seconds for a schema of a few megabytes) on a worker thread, so the event loop keeps
        serving meanwhile; their ``ApiError`` reaches the client as raised."""
        return await asyncio.get_running_loop().run_in_executor(self._check_pool, fn)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._check_pool.shutdown(wait=False, cancel_futures=True)

    def check_size(self, num_sequences: int, param: str = "n") -> None:
        """Refuse a request of more sub-requests than the limit, or more than the queue
        has room for now."""
        limit = self.config.max_request_sequences
        if num_sequences > limit:
            raise ApiError(
                400,
                f"this request asks for {num_sequences} sequences (prompts x n); "
                f"the server's limit is {limit} (--max-request-sequences)",
                param,
            )
        queued = self.client.num_inflight + num_sequences - self.max_running
        if queued > self.config.max_queued_requests:
            self.metrics.on_rejected("queue_full")
            raise unavailable(
                f"the server is busy ({self.client.num_inflight} sequences in flight, "
                f"queue limit {self.config.max_queued_requests}); retry shortly"
            )

    async def submit(
        self, kind: str, prompts: list[list[int]], params: list[SamplingParams], spec: RequestSpec
    ) -> tuple[Job, asyncio.Queue]:
        """One engine request per prompt, each ``spec`` with its own id, prompt and params."""
        self.check_size(len(prompts))
        limit = self.client.info.max_model_len
        longest = max(map(len, prompts), default=0)
        if limit and longest >= limit:  # refused here, not shipped to the engine to be refused
            raise ApiError(
                400,
                f"the prompt has {longest} tokens but the model's context is {limit} tokens, "
                "which must also hold at least one output token",
            )
        vocab = self.client.info.vocab_size
        if any(ids and (min(ids) < 0 or max(ids) >= vocab) for ids in prompts):  # JSON ints
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})")
        base = uuid.uuid4().hex[:24]
        job = Job(
            kind=kind, prompts=prompts, trackers=[], request_ids=[], response_id=f"{kind}-{base}"
        )
        specs = []
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            rid = f"{base}-{i}"
            job.trackers.append(OutputTracker(rid, self.tokenizer, p))
            job.request_ids.append(rid)
            specs.append(spec.with_prompt(rid, ids, p))
        queue: asyncio.Queue = asyncio.Queue()
        try:  # all of them, or (refused, no engine) none
            await self.client.add(specs, queue)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        except EngineDeadError as e:
            raise unavailable(str(e)) from e
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
                raise unavailable(str(out))
            tracker = job.trackers[tag]
            if tracker.finished:
                continue  # the engine's answer to our own abort after a stop string
            now = time.monotonic()
            if out.finish_reason == "error":
                tracker.finish_reason = "error"
                self.metrics.on_finished("error", now - job.arrival)
                raise ApiError(500, out.error or ENGINE_ERROR, kind="server_error")
            if out.new_token_ids:
                self.metrics.on_tokens(len(out.new_token_ids))
                if tag not in last_token_at:
                    self.metrics.ttft.labels(self.metrics.model_name).observe(now - job.arrival)
                    self.metrics.on_admitted(out.usage.prompt_tokens, out.usage.cached_tokens)
                else:
                    self.metrics.itl.labels(self.metrics.model_name).observe(
                        now - last_token_at[tag]
                    )
                last_token_at[tag] = now
            if tracker.update(out):
                await self.client.abort(job.request_ids[tag], reason="stop")
            if tracker.finished:
                self.metrics.on_finished(tracker.finish_reason, now - job.arrival)
                if job.on_finish is not None and tracker.finish_reason in ("stop", "length"):
                    job.on_finish(tracker)
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
        wire: Wire | None = None,
        idle: Callable[[Job], list[dict]] | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events: ``chunks(job, index)`` after each change, ``final(job)`` last,
        written as ``wire`` says (OpenAI's by default). After ``KEEPALIVE_SECONDS`` without
        a change: ``idle(job)``'s events (the API's opening events, then its own keepalive
        where it has one), or an SSE comment. A client that disconnects cancels this
        generator; its sub-requests are aborted."""
        wire = wire or OPENAI_WIRE
        try:
            async for tag in with_keepalives(self.events(job, queue)):
                if tag is None:
                    said = [wire.event(c) for c in idle(job)] if idle is not None else []
                    yield "".join(said) or KEEPALIVE_COMMENT
                    continue
                for chunk in chunks(job, tag):
                    yield wire.event(chunk)
            for chunk in final(job):
                yield wire.event(chunk)
            yield wire.done
        except ApiError as e:
            yield wire.event(wire.error(e))
        except Exception:
            log.exception("a stream failed")
            yield wire.event(wire.error(internal_error()))
        finally:
            await self.abort_unfinished(job)


async def with_keepalives(tags: AsyncIterator[int]) -> AsyncIterator[int | None]:
    """``tags``, with a None whenever ``KEEPALIVE_SECONDS`` pass without one. The pending
    read is awaited again, never cancelled (cancelling it would close ``tags``)."""
    it = aiter(tags)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_SECONDS)
            if not done:
                yield None
                continue
            try:
                tag = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield tag
    finally:
        if pending is not None:
            pending.cancel()  # a client gone: the read is let go before the source closes
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
        await it.aclose()
