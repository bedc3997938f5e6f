"""Engine: a model, its KV pool and prefix cache, an ``EngineCore`` and a ``ModelExecutor``.

The engine speaks token ids only. ``add`` (or ``add_request``) validates a ``RequestSpec``
and queues it; each ``step`` is the core's ``schedule -> executor.run -> postprocess`` and
returns a ``StepOutput`` per request that produced a token or finished. Text, stop strings
and chat templates belong to the front end (``output.py``, ``llm.py``, the server), which
calls ``abort_request`` when a stop string ends a request early.

A step that fails does not take the engine down (``executor.py``): the requests it failed
end with ``finish_reason="error"`` and their slots go back through their ledgers.
``stats()`` and ``info()`` are the engine's typed boundary (``stats.py``): callers never
reach into the scheduler, allocator or cache.

In a disaggregation mode (``radixserve/disagg``) the engine carries that feature as a hook
(``hooks.py``): a prefill engine turns decode instances' transfer requests into prefill-only
requests; a decode engine loads prompts' KV from a prefill instance through the scheduler's
``KVSource``. ``wake_fd()`` then tells an idle loop when transfer traffic needs a step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from radixserve.cache import KVEventQueue
from radixserve.cache.base import TreeSummary
from radixserve.cache.events import BlockStored, KVEvent
from radixserve.cache.pins import PinInfo, PinStats
from radixserve.cache.storage import ClearResult
from radixserve.config import EngineConfig
from radixserve.engine.cache_setup import build_cache, build_pool, pin_table, window_share
from radixserve.engine.core import EngineCore, Limits, StepOutput
from radixserve.engine.drafts import build_drafts
from radixserve.engine.executor import ModelExecutor
from radixserve.engine.features import StepRecord, StepShape, TierTransfers
from radixserve.engine.hooks import Feature, KVTransfer
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.pin_requests import PinRequests
from radixserve.engine.request import Request
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.segment_select import RecomputeSelector
from radixserve.engine.segments import SegmentBlender
from radixserve.engine.spec import RequestSpec
from radixserve.engine.stats import EngineInfo, EngineStats, WindowStats
from radixserve.model import LoadedModel, load_model, native
from radixserve.model.kv_layers import float_kv_layers
from radixserve.structured import GrammarCompiler, GrammarStats
from radixserve.utils import default_kv_cache_bytes

__all__ = ["Engine", "StepOutput"]

log = logging.getLogger("radixserve")


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        transfer: Callable[[Engine], KVTransfer] | None = None,
    ):
        """``transfer``: in a disaggregation mode, builds the KV transfer feature of this
        engine (``radixserve.disagg.Disaggregation``)."""
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
        asked = config.scheduler.max_model_len
        if asked is not None and asked > model_len:
            raise ValueError(
                f"max_model_len {asked} is beyond the {model_len} tokens of context "
                f"{self.model_name} was trained for (radixserve does not extend a model's "
                "context with RoPE scaling)"
            )
        self.max_model_len = asked or model_len
        self._build_kv(config, loaded)
        self.disagg: KVTransfer | None = None
        if config.disagg.disaggregation_mode != "off":
            if transfer is None:
                raise ValueError(
                    f"disaggregation_mode {config.disagg.disaggregation_mode!r} needs the KV "
                    "transfer feature: Engine(config, transfer=radixserve.disagg.Disaggregation)"
                )
            self.disagg = transfer(self)
        self.record = StepRecord(self.cache)
        features: list[Feature] = [self.record, TierTransfers(self.tiers, self._has_waiting)]
        if self.disagg is not None:
            features.append(self.disagg)
        self.pins = pin_table(config, self.cache, self.tiers)
        if self.pins is not None:
            features.append(PinRequests(self.pins))
            self.kv.pins = self.pins
        vocab, eos = self.model.config.vocab_size, frozenset(self.tokenizer.eos_token_ids)
        limits = Limits(self.max_model_len, vocab, eos)
        source = self.disagg and self.disagg.kv_source
        self.drafts = build_drafts(config.drafts, eos, self.cache)
        self.core = EngineCore(config, self.kv, limits, source, features, self.drafts)
        self.scheduler, self.requests = self.core.scheduler, self.core.requests
        seg = config.segments
        select = RecomputeSelector(
            self.model, self.pool, seg.segment_first_tokens, seg.segment_deviation_layer
        )
        self.segments = SegmentBlender(self.model, self.pool, self.cache, self.kv,
                                       seg.segment_recompute_ratio, select,
                                       prefix_tokens=seg.segment_prefix_tokens)  # fmt: skip
        self.executor = ModelExecutor(self.model, self.pool, self.segments)
        self._grammars: GrammarCompiler | None = None

    def _build_kv(self, config: EngineConfig, loaded: LoadedModel) -> None:
        """The KV pool, its allocator, the prefix cache, the tiers below it and the ledgers."""
        shape = self.model.kv_shape()
        if config.cache.kv_cache_dtype == "int8":
            floats = float_kv_layers(self.model, config.cache.kv_float_layers)
            shape = shape.with_format(shape.int8_format, floats)
        share = window_share(config, shape)  # 0: every layer's KV in one pool
        if config.cache.max_total_tokens is not None:
            num_slots = config.cache.max_total_tokens
        else:
            budget = config.cache.kv_cache_memory or default_kv_cache_bytes(config.device)
            num_slots = shape.slots_for_memory(int(budget), config.cache.page_size, share)
        if torch.device(config.device).type == "cpu":
            native.paged_ops()  # build (first run) or load the kernels now, not mid-request
        window = self.model.config.sliding_window
        self.allocator, self.pool = build_pool(config, shape, num_slots, window, share)
        events = KVEventQueue() if config.kv_events.enable_kv_events else None
        self.cache, self.tiers = build_cache(
            config, self.allocator, self.pool, events, loaded.path, loaded.name
        )
        self.cache.set_turn_end_ids(self.tokenizer.eos_token_ids)
        self.kv = RequestKV(self.cache, self.allocator, self.tiers)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, **options: Any
    ) -> Request:
        """``add`` for in-process callers: ``options`` are ``RequestSpec`` fields."""
        return self.add(
            RequestSpec(request_id=request_id, prompt_ids=prompt_ids, params=params, **options)
        )

    def add(self, spec: RequestSpec) -> Request:
        """Validate and queue a request (``ValueError`` naming what is wrong); a constrained
        one starts compiling its grammar and is admitted once it is ready."""
        if spec.segments and self.model.config.sliding_layers:
            raise ValueError(
                "RAG segments are not available for models with sliding-window layers (Gemma 3):"
                " reusing a segment moves every layer's keys with the global layers' RoPE"
            )
        req = self.core.add(spec)
        if spec.grammar is not None:
            req.grammar = self.grammars.start(*spec.grammar)
        return req

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's vocabulary, built on first use."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer.hf, self.model.config.vocab_size, self.tokenizer.eos_token_ids
            )
        return self._grammars

    def grammar_stats(self) -> GrammarStats:
        return dataclasses.replace(self._grammars.stats) if self._grammars else GrammarStats()

    def abort_request(self, request_id: str, reason: str = "abort") -> StepOutput | None:
        return self.core.abort(request_id, reason)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def apply_finished_transfers(self) -> None:
        """Apply the tier moves that finished since the last step (an idle engine loop calls
        this: otherwise write-outs that end after the last request stay unaccounted, and
        their host pages pinned, until the next request)."""
        self.tiers.poll()

    def wake_fd(self) -> int | None:
        """A descriptor readable when KV transfer traffic needs a ``step`` (None: no mode)."""
        return self.disagg.fileno() if self.disagg is not None else None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        failed = self._failed_grammars()
        step = self.core.schedule()
        if step.empty:  # nothing to compute; requests may have begun loading their KV
            return failed + self.core.admissions(step)
        return failed + self.core.postprocess(step, self.executor.run(step))

    def _failed_grammars(self) -> list[StepOutput]:
        """Fail the waiting requests whose grammar could not be compiled."""
        if self._grammars is None:
            return []
        failed = [r for r in self.scheduler.waiting if r.grammar and r.grammar.error]
        return [self.core.fail(r, r.grammar.error) for r in failed]

    def _has_waiting(self) -> bool:
        return bool(self.scheduler.waiting)

    @property
    def last_step_empty(self) -> bool:
        """The last step could run nothing (an engine loop may sleep a little)."""
        return self.record.empty

    @property
    def last_step_shape(self) -> StepShape | None:
        """The last step's prompt chunks and decode contexts, while ``record_step_shape``."""
        return self.record.shape

    @property
    def record_step_shape(self) -> bool:
        return self.record.record_shape

    @record_step_shape.setter
    def record_step_shape(self, on: bool) -> None:
        self.record.record_shape = on

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
            kv_format=self.pool.shape.format_name,
            prefix_caching=self.cache.reuses_prefixes,
            kv_events_block_size=self.cache.event_block_size,
            disaggregation=self.disagg.info() if self.disagg is not None else None,
            pin_budget_tokens=self.pins.stats.budget_tokens if self.pins is not None else 0,
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
            step_evicted_tokens=self.record.evicted_tokens,
            cache=self.cache.stats.copy(),
            tiers=self.tiers.stats(),
            segments=dataclasses.replace(self.segments.stats),
            grammar=self.grammar_stats(),
            drafts=self.drafts.stats.copy(),
            num_loading=len(self.scheduler.loading),
            kv_transfer=self.disagg.stats() if self.disagg is not None else None,
            window=self._window_stats(),
            pins=self._pin_stats(),
            eviction=self.cache.eviction_stats(),
        )

    def _window_stats(self) -> WindowStats | None:
        if not self.allocator.windowed:
            return None
        keeper = self.cache.windows  # a windowed allocator always comes with the radix tree
        capacity = self.allocator.window_slots
        return WindowStats(
            capacity_tokens=capacity,
            used_tokens=capacity - self.allocator.window_free_size(),
            cached_tokens=keeper.window_size,
            tombstoned_tokens=keeper.tombstoned_tokens,
        )

    def cache_summary(self, top: int = 10) -> TreeSummary:
        """The longest shared prefixes and node counts (``/cache``); walks the whole tree."""
        return self.cache.summary(top)

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def _pin_stats(self) -> PinStats | None:
        if self.pins is None:
            return None
        self.pins.expire()  # an idle engine runs no step that would
        return self.pins.snapshot()

    def pin_listing(self) -> list[PinInfo]:
        """The pinned prefixes (empty when pins are off)."""
        if self.pins is None:
            return []
        self.pins.expire()
        return self.pins.listing()

    def unpin(self, token_ids: list[int] | None = None, namespace: str | None = None,
              tenant: str | None = None, pin_id: int | None = None) -> int:  # fmt: skip
        """Drop pins (``PinTable.unpin``); how many."""
        if self.pins is None:
            return 0
        return self.pins.unpin(token_ids, namespace, tenant, pin_id)

    def flush_cache(self) -> int:
        """Drop every unlocked cached token from the device and host tiers (not storage)."""
        return self.cache.reset()

    def clear_storage(self) -> ClearResult | None:
        """Delete this model's pages from the storage tier: whether none is left (else why
        not), or None when there is no storage tier."""
        return self.tiers.clear_storage()

    def close(self) -> None:
        """Finish pending writes to the storage tier, stop its threads and the KV transfer;
        the engine is not used afterwards."""
        if self.disagg is not None:
            self.disagg.close()
        if self._grammars is not None:
            self._grammars.close()
        self.tiers.close()

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
