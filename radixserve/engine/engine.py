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

In a disaggregation mode (``radixserve/disagg``) the engine also serves or takes KV transfers:
a prefill engine turns decode instances' transfer requests into prefill-only requests (which
sample nothing and produce no outputs); a decode engine loads prompts' KV from a prefill
instance through the scheduler's ``KVSource``. ``wake_fd()`` then tells an idle loop when
transfer traffic needs a step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.cache import KVEventQueue, KVPool, PagedAllocator
from radixserve.cache.base import TreeSummary
from radixserve.cache.events import BlockStored, KVEvent
from radixserve.cache.storage import ClearResult
from radixserve.config import EngineConfig
from radixserve.engine.cache_setup import build_cache
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.request import Request, RequestStatus, TokenLogprob
from radixserve.engine.sampler import sample
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import Scheduler, Step
from radixserve.engine.segment_select import RecomputeSelector
from radixserve.engine.segments import SegmentBlender, validate_ratio, validate_segments
from radixserve.engine.stats import EngineInfo, EngineStats
from radixserve.model import LoadedModel, build_forward_batch, load_model, native
from radixserve.utils import default_kv_cache_bytes

log = logging.getLogger("radixserve")
IDLE_TRANSFER_WAIT_S = 0.01


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int  # from every tier; of which:
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None  # with finish_reason "error": a short message for the client
    host_cached_tokens: int = 0  # loaded back from the host tier
    segment_hits: int = 0  # RAG segments found in the segment store
    reused_tokens: int = 0  # prompt tokens whose KV came from stored segments
    recomputed_tokens: int = 0  # reused segment tokens computed again (partial recompute)
    storage_cached_tokens: int = 0  # fetched from the storage tier


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if loaded is None:
            loaded = load_model(
                config.model, config.device, config.dtype, config.load_progress,
                config.quantization,
            )  # fmt: skip
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
        events = KVEventQueue() if config.enable_kv_events else None
        self.cache = build_cache(
            config, self.allocator, self.pool, events, loaded.path, loaded.name
        )
        self.kv = RequestKV(self.cache, self.allocator)
        self.disagg = None
        if config.disaggregation_mode != "off":
            from radixserve.disagg.engine_side import Disaggregation

            self.disagg = Disaggregation(self)
        self.scheduler = Scheduler(config, self.kv, self.disagg and self.disagg.source)
        self.segments = SegmentBlender(
            self.model,
            self.pool,
            self.cache,
            self.kv,
            config.segment_recompute_ratio,
            RecomputeSelector(
                self.model, self.pool, config.segment_first_tokens, config.segment_deviation_layer
            ),
            prefix_tokens=config.segment_prefix_tokens,
        )
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self.last_step_evicted_tokens = 0  # for the per-step eviction histogram
        self.last_step_empty = False  # nothing could run: an engine loop may sleep a little
        # (prompt chunks as (tokens, position), decode contexts) of the last step, kept when
        # an engine loop writes a step trace (engine/step_trace.py)
        self.record_step_shape = False
        self.last_step_shape: tuple[list[tuple[int, int]], list[int]] | None = None

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        extra_key: Any = None,
        *,
        prefill_peer: str | None = None,
        prefill_only: bool = False,
        segments: list[tuple[int, int]] | None = None,
        recompute_ratio: float | None = None,
    ) -> Request:
        """Queue a request. ``segments``: sorted, disjoint ``(start, end)`` prompt ranges whose
        KV may be reused wherever they appear (RAG passages; see ``segments.py``), with
        ``recompute_ratio`` of their tokens computed again (None: the engine's default)."""
        if prefill_peer is not None:
            if self.config.disaggregation_mode != "decode":
                raise ValueError("a prefill instance was named but this is not a decode instance")
            self.disagg.check_peer(prefill_peer)
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
            if self.config.disaggregation_mode != "off":
                raise ValueError("RAG segments are not supported with disaggregation")
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
        req.prefill_peer, req.prefill_only = prefill_peer, prefill_only
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
        s = self.scheduler
        return bool(s.waiting or s.running or s.loading)

    def wake_fd(self) -> int | None:
        """A descriptor readable when KV transfer traffic needs a ``step`` (None: no mode)."""
        return self.disagg.fileno() if self.disagg is not None else None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        self.cache.poll_transfers()
        if self.disagg is not None:
            self.disagg.poll()  # prefill: take transfer requests, drop cancelled ones
        evicted_before = self.cache.stats.evicted_tokens
        step = self.scheduler.schedule()
        self.last_step_evicted_tokens = self.cache.stats.evicted_tokens - evicted_before
        self.last_step_empty = step.empty
        self.last_step_shape = None
        if step.empty:
            if self.scheduler.waiting:  # maybe waiting for pages: wait for a transfer, not spin
                self.cache.poll_transfers(timeout=IDLE_TRANSFER_WAIT_S)
            return []
        outputs, blended, blend_logits = self._blend(step)
        if self.record_step_shape:
            self.last_step_shape = (
                [(n, r.num_computed) for r, n in step.prefills],
                [r.num_computed for r in step.decodes],
            )
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
            if r.num_computed == r.num_tokens and not r.prefill_only:
                sampling.append(r)
        for r in blended:
            self.kv.commit(r, r.num_uncomputed)
            self.kv.publish(r)
            sampling.append(r)
        if self.disagg is not None:  # prefill: push the new KV, end fully pushed requests
            self.disagg.after_step([r for r, _ in step.prefills if r.prefill_only])
        if blend_logits:
            logits = torch.cat(([] if logits is None else [logits]) + blend_logits)
        drawn_all = self._sample(logits, sampling) if sampling else []
        for r, drawn in zip(sampling, drawn_all, strict=True):
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

    def _blend(self, step: Step) -> tuple[list[StepOutput], list[Request], list[torch.Tensor]]:
        """Take the prefills that reuse RAG segments out of ``step`` and run each alone (one
        sparse forward over its whole context); return failures, the done ones, their logits."""
        outputs, done, logits = [], [], []
        blended = [r for r, n in step.prefills if self.segments.applies(r, n)]
        step.prefills = [(r, n) for r, n in step.prefills if r not in blended]
        for r in blended:
            try:
                logits.append(self.segments.prefill(r))
                done.append(r)
            except Exception as e:
                log.exception("a segment prefill failed; failing its request")
                outputs.append(self._fail(r, e))
        return outputs, done, logits

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
                r.num_computed + n == r.num_tokens and not r.prefill_only,
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
        if self.disagg is not None and req.prefill_only:
            self.disagg.on_failed(req, type(error).__name__)
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
            host_cached_tokens=req.host_cached_tokens,
            segment_hits=req.segment_hits,
            reused_tokens=req.segment_reused_tokens,
            recomputed_tokens=req.segment_recomputed_tokens,
            storage_cached_tokens=req.storage_cached_tokens,
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
            kv_events_block_size=self.cache.event_block_size,
            disaggregation=self.disagg.info() if self.disagg is not None else None,
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
            tiers=self.cache.tier_stats(),
            segments=dataclasses.replace(self.segments.stats),
            num_loading=len(self.scheduler.loading),
            kv_transfer=self.disagg.stats() if self.disagg is not None else None,
        )

    def cache_summary(self, top: int = 10) -> TreeSummary:
        """The longest shared prefixes and node counts (``/cache``); walks the whole tree."""
        return self.cache.summary(top)

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.scheduler.running + self.scheduler.loading)

    def flush_cache(self) -> int:
        """Drop every unlocked cached token from the device and host tiers (not storage)."""
        return self.cache.reset()

    def clear_storage(self) -> ClearResult | None:
        """Delete this model's pages from the storage tier: whether none is left (else why
        not), or None when there is no storage tier."""
        return self.cache.clear_storage()

    def close(self) -> None:
        """Finish pending writes to the storage tier, stop its threads and the KV transfer;
        the engine is not used afterwards."""
        if self.disagg is not None:
            self.disagg.close()
        self.cache.close()

    # ------------------------------------------------------------------ KV events
    @property
    def kv_events(self) -> KVEventQueue | None:
        """The queue of KV events while they are on, else None: the cache's own state, the
        only one (what emits an event later, such as a storage write-out, asks the cache)."""
        return self.cache.events

    def set_kv_events(self, on: bool) -> None:
        """Switch KV events on (``AllBlocksCleared`` and a snapshot of the tree come first) or
        off (no hashing at all until they are switched on again)."""
        if on and self.kv_events is None:
            self.cache.enable_events(KVEventQueue())
        elif not on and self.kv_events is not None:
            self.cache.disable_events()

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv_events.drain() if self.kv_events is not None else []

    def kv_events_snapshot(self) -> list[BlockStored]:
        """Every cached block as stored events, parents first (a dump for a subscriber)."""
        return self.cache.snapshot_events()
