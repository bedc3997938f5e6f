"""Engine: the step loop tying model, KV pool, prefix cache, scheduler and sampler together.

The engine speaks token ids only. ``add_request`` validates a request (clear ``ValueError``s
for empty, out-of-vocabulary, too-long or pool-exceeding prompts) and queues it; each
``step`` schedules one batch, runs one forward pass, samples, and returns a ``StepOutput``
per request that produced a token or finished. Text, stop strings and chat templates belong
to the front end (``output.py``, ``llm.py``, the server), which calls ``abort_request`` when a
stop string ends a request early.

A step that fails does not take the engine down: if the forward pass raises, the requests of
that step end with ``finish_reason="error"``; if sampling raises, each row is sampled alone and
only the requests whose rows fail end so. Their slots go back through their ledgers, and the
traceback goes to the log, never to the client. ``stats()`` and ``info()`` are the engine's
typed boundary (``stats.py``): callers never reach into the scheduler, allocator or cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.cache import KVEventQueue, KVPool, NullCache, PagedAllocator, RadixCache
from radixserve.cache.base import TreeSummary
from radixserve.config import EngineConfig
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.request import Request, RequestStatus, TokenLogprob
from radixserve.engine.sampler import sample
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import Scheduler, Step
from radixserve.engine.segments import SegmentBlender, validate_ratio, validate_segments
from radixserve.engine.stats import EngineInfo, EngineStats
from radixserve.model import LoadedModel, build_forward_batch, load_model, native
from radixserve.utils import default_kv_cache_bytes

log = logging.getLogger("radixserve")


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None  # with finish_reason "error": a short message for the client
    segment_hits: int = 0  # RAG segments found in the segment store
    reused_tokens: int = 0  # prompt tokens whose KV came from stored segments
    recomputed_tokens: int = 0  # reused segment tokens computed again (partial recompute)


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if loaded is None:
            loaded = load_model(config.model, config.device, config.dtype, config.load_progress)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        model_len = self.model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        shape = self.model.kv_shape()
        if config.max_total_tokens is not None:
            num_slots = config.max_total_tokens
        else:
            budget = config.kv_cache_memory or default_kv_cache_bytes(config.device)
            num_slots = shape.slots_for_memory(int(budget), config.page_size)
        if torch.device(config.device).type == "cpu":
            native.paged_ops()  # build (first run) or load the kernels now, not mid-request
        self.allocator = PagedAllocator(num_slots, config.page_size)
        self.pool = KVPool(shape, self.allocator.num_slots, config.device)
        self.kv_events = KVEventQueue() if config.enable_kv_events else None
        if config.enable_prefix_caching:
            self.cache = RadixCache(self.allocator, config.eviction_policy, self.kv_events)
        else:
            self.cache = NullCache(self.allocator)
        self.kv = RequestKV(self.cache, self.allocator)
        self.scheduler = Scheduler(config, self.kv)
        self.segments = SegmentBlender(
            self.model,
            self.pool,
            self.cache,
            self.kv,
            config.segment_recompute_ratio,
            config.segment_first_tokens,
            config.segment_deviation_layer,
        )
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self.last_step_evicted_tokens = 0  # for the per-step eviction histogram

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        extra_key: Any = None,
        segments: list[tuple[int, int]] | None = None,
        recompute_ratio: float | None = None,
    ) -> Request:
        """Queue a request. ``segments``: sorted, disjoint ``(start, end)`` prompt ranges whose
        KV may be reused wherever they appear (RAG passages; see ``segments.py``), with
        ``recompute_ratio`` of their tokens computed again (None: the engine's default)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate()  # again: unpickled params never ran __post_init__
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len} "
                "tokens, which must also hold at least one output token"
            )
        capacity = self.allocator.num_slots
        if params.max_tokens is None:
            max_tokens = min(self.max_model_len, capacity) - n
        else:
            max_tokens = params.max_tokens
            if n + max_tokens > self.max_model_len:
                raise ValueError(
                    f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the "
                    f"model's context of {self.max_model_len} tokens"
                )
        page = self.allocator.page_size
        if max_tokens < 1 or -(-(n + max_tokens) // page) > self.allocator.num_pages:
            raise ValueError(
                f"this request needs up to {n + max(max_tokens, 1)} KV slots (prompt {n} + "
                f"max_tokens {max_tokens}) but the KV pool holds only {capacity}; lower "
                "max_tokens or give the pool more memory (max_total_tokens / kv_cache_memory)"
            )
        if segments:
            validate_segments(segments, n)
        if recompute_ratio is not None:
            validate_ratio(recompute_ratio)
        seed = params.seed if params.seed is not None else self._next_seed()
        req = Request(
            request_id,
            prompt_ids,
            params,
            max_tokens,
            seed,
            extra_key,
            arrival=next(self._arrivals),
            segments=segments,
            recompute_ratio=recompute_ratio,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _next_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._seeds))

    def abort_request(self, request_id: str, reason: str = "abort") -> StepOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, reason)
        return self._output(req, [], [])

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        evicted_before = self.cache.stats.evicted_tokens
        step = self.scheduler.schedule()
        self.last_step_evicted_tokens = self.cache.stats.evicted_tokens - evicted_before
        if step.empty:
            return []
        blended = [r for r, n in step.prefills if self.segments.applies(r, n)]
        step.prefills = [(r, n) for r, n in step.prefills if r not in blended]
        outputs, blend_logits, blend_done = [], [], []
        for r in blended:  # each alone: one sparse forward over its whole context
            try:
                blend_logits.append(self.segments.prefill(r))
                blend_done.append(r)
            except Exception as e:
                log.exception("a segment prefill failed; failing its request")
                outputs.append(self._fail(r, e))
        try:
            logits = self._forward(step) if not step.empty else None
        except Exception as e:
            log.exception("the forward pass failed; failing the requests of this step")
            failed = step.decodes + [r for r, _ in step.prefills]
            return outputs + [self._fail(r, e) for r in failed]
        sampling = list(step.decodes)
        for r in step.decodes:
            self.kv.commit(r, 1)
        for r, n in step.prefills:
            self.kv.commit(r, n)
            self.kv.publish(r)
            if r.num_computed == r.num_tokens:
                sampling.append(r)
        for r in blend_done:
            self.kv.commit(r, r.num_uncomputed)
            self.kv.publish(r)
            sampling.append(r)
        if not sampling:
            return outputs
        logits = torch.cat(([] if logits is None else [logits]) + blend_logits)
        for r, drawn in zip(sampling, self._sample(logits, sampling), strict=True):
            if isinstance(drawn, Exception):
                outputs.append(self._fail(r, drawn))
                continue
            token, logprob = drawn
            r.append_token(token)
            if logprob is not None:
                r.logprobs.append(logprob)
            reason = self._stop_reason(r, token)
            if reason is not None:
                self.scheduler.finish(r, reason)
                self.requests.pop(r.request_id, None)
            outputs.append(self._output(r, [token], [logprob] if logprob else []))
        return outputs

    def _forward(self, step: Step) -> torch.Tensor:
        decode = [
            (int(r.token_ids[r.num_computed]), r.num_computed, r.kv.slots[: r.num_computed + 1])
            for r in step.decodes
        ]
        prefill = [
            (
                torch.from_numpy(r.token_ids[r.num_computed : r.num_computed + n]),
                r.num_computed,
                r.kv.slots[: r.num_computed + n],
                r.num_computed + n == r.num_tokens,
            )
            for r, n in step.prefills
        ]
        batch = build_forward_batch(decode, prefill, self.model.device, self.pool.pad_slot)
        return self.model.forward(batch, self.pool)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list:
        """One ``(token, logprob)`` per request, or the exception its row raised."""
        try:
            return list(sample(logits, reqs))
        except Exception:
            log.exception("sampling a batch failed; sampling its rows one by one")
        drawn: list = []
        # Each request draws from its own generator, so a row sampled alone gets what it would
        # have got in the batch (unless the failed batch call had already advanced it).
        for i, r in enumerate(reqs):
            try:
                drawn.append(sample(logits[i : i + 1], [r])[0])
            except Exception as e:
                drawn.append(e)
        return drawn

    def _fail(self, req: Request, error: Exception) -> StepOutput:
        self.scheduler.finish(req, "error")
        self.requests.pop(req.request_id, None)
        out = self._output(req, [], [])
        out.error = f"internal error while generating ({type(error).__name__})"
        return out

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if (
            not p.ignore_eos and token in self.tokenizer.eos_token_ids
        ) or token in p.stop_token_ids:
            return "stop"
        if req.num_output >= req.max_tokens:
            return "length"
        return None

    def _output(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob]) -> StepOutput:
        return StepOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            finished=req.status is RequestStatus.FINISHED,
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            new_logprobs=logprobs,
            segment_hits=req.segment_hits,
            reused_tokens=req.segment_reused_tokens,
            recomputed_tokens=req.segment_recomputed_tokens,
        )

    # ------------------------------------------------------------------ inspection
    def info(self) -> EngineInfo:
        return EngineInfo(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.model.config.vocab_size,
            page_size=self.allocator.page_size,
            kv_capacity_tokens=self.kv.capacity(),
            kv_bytes=self.pool.nbytes(),
            kv_bytes_per_token=self.pool.shape.bytes_per_token(),
            dtype=str(self.pool.shape.dtype).removeprefix("torch."),
            prefix_caching=self.cache.reuses_prefixes,
        )

    def stats(self) -> EngineStats:
        capacity = self.kv.capacity()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_capacity_tokens=capacity,
            kv_used_tokens=capacity - self.allocator.free_size(),
            kv_available_tokens=self.kv.available(),
            cached_tokens=self.cache.total_size(),
            evictable_tokens=self.cache.evictable_size(),
            num_retractions=self.scheduler.num_retractions,
            step_evicted_tokens=self.last_step_evicted_tokens,
            cache=self.cache.stats.copy(),
            segments=dataclasses.replace(self.segments.stats),
        )

    def cache_summary(self, top: int = 10) -> TreeSummary:
        """The longest shared prefixes and node counts (``/cache``); walks the whole tree."""
        return self.cache.summary(top)

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.scheduler.running)

    def flush_cache(self) -> int:
        return self.cache.reset()
