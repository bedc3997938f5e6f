"""Scheduler: picks each step's work under the KV budget (continuous batching).

Every step runs, in one forward pass:
1. one decode token for every running request that has finished its prefill; if the pool
   cannot give them a slot even after evicting unlocked cache, the newest running requests
   are retracted (their computed tokens go to the tree, so resuming re-matches them);
2. the next prefill chunks of running requests, then newly admitted requests in policy order,
   up to ``chunked_prefill_size`` prompt tokens in all.

Admission needs ``uncached prompt + reserved output`` slots out of ``free + evictable`` minus
what running requests still need; reserved output is ``min(remaining, 4096) * ratio``, a
ratio that decays while memory suffices and jumps back after a retraction. A queued request
sharing a long uncomputed prefix with one already prefilling waits until that prefix is in
the tree (in-batch deduplication), then hits it instead of computing it twice. With a
hierarchical cache, an admitted request's host-tier part is loaded onto the device before
the step (``RequestKV.load``), and a request whose pages are being fetched from storage is not
admitted until they are in, or its prefetch timed out.

With a ``KVSource`` (``kv_source.py``), an admitted request whose missing KV the source can
bring (from a prefill instance) takes its slots and waits in ``loading`` instead, using no
prefill budget; each step first lands finished loads (those requests then decode) and
re-queues failed ones to be computed here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from radixserve.config import SchedulerConfig
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.kv_source import KVSource
from radixserve.engine.policy import order_waiting
from radixserve.engine.request import Request, RequestStatus

CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
RETRACT_NEW_TOKEN_RATIO = 0.9
DEDUP_MIN_SHARED_TOKENS = 32


@dataclass
class Step:
    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk size)
    admitted: list[Request] = field(default_factory=list)  # first admitted: cache hit known

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    def sampling(self) -> list[Request]:
        """The requests that draw a token after this step: every decode, then each prefill
        that completes its prompt (a prefill-only request never samples). Asked before the
        step's tokens are committed."""
        return self.decodes + [
            r
            for r, n in self.prefills
            if r.num_computed + n == r.num_tokens and not r.spec.prefill_only
        ]


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differs = a[:n] != b[:n]
    return int(differs.argmax()) if differs.any() else n


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: RequestKV, source: KVSource | None = None):
        self.config = config
        self.kv = kv
        self.source = source
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted, holding slots, their KV on its way
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.kv.start_prefetch(req)

    def _reserved_output(self, req: Request) -> int:
        return math.ceil(min(req.remaining_output, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    def _future_need(self, req: Request) -> int:
        if req.status is RequestStatus.LOADING:  # its prompt's slots are allocated but one
            ahead = req.num_tokens - req.kv.allocated
        else:
            ahead = req.num_uncomputed - 1
        return max(ahead, 0) + self._reserved_output(req)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Step:
        self._land_loads()
        self._drop_drafts_if_short()
        step = Step()
        decodes = [r for r in self.running if r.is_decoding]
        while decodes and not self.kv.extend_decode(decodes):
            victim = self._retract_newest()
            if victim in decodes:
                decodes.remove(victim)
        step.decodes = decodes
        budget = self.config.chunked_prefill_size
        blocked = False
        for r in sorted((r for r in self.running if not r.is_decoding), key=lambda r: r.arrival):
            if budget == 0:
                break
            n = self._chunk(r, self.kv.prefill_chunk(r, budget))
            if n and r.num_draft and not self.kv.extend(r, n):
                r.trim_draft()  # memory is short: it decodes without its draft
            if r.is_decoding:  # its draft was cut away: a decode row, as without drafts
                if not self.kv.extend(r, 1):
                    blocked = True
                    break
                step.decodes.append(r)
                continue
            if not n or (not r.num_draft and not self.kv.extend(r, n)):
                blocked = True
                break
            step.prefills.append((r, n))
            budget -= n
        if not blocked and self.waiting and (budget > 0 or self.source is not None):
            self._admit(step, budget)
        if step.empty and self.running:
            self._retract_newest()  # memory too short for anyone: make room for the oldest
        self.decay(1)
        return step

    def _drop_drafts_if_short(self) -> None:
        """Drafts are only worth their slots while memory is plenty: when the memory
        obtainable now does not hold every running request's next tokens, drafts included
        (a page more each), every draft is dropped, and its request decodes (retracting
        others, as any decode, if even that does not fit)."""
        drafted = [r for r in self.running if r.num_draft]
        if not drafted:
            return
        need = sum(r.num_uncomputed + self.kv.page_size for r in self.running if r.is_decoding
                   or r.num_draft)  # fmt: skip
        if need > self.kv.available():
            for r in drafted:
                r.trim_draft()

    def decay(self, steps: int) -> None:
        """Lower the output reservation ratio as ``steps`` steps with enough memory do."""
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - steps * NEW_TOKEN_RATIO_DECAY
        )

    def _admit(self, step: Step, budget: int) -> None:
        ordered = order_waiting(
            self.waiting, self.config.schedule_policy, self.kv, self.config.max_overtakes
        )
        reserved = sum(self._future_need(r) for r in self.running + self.loading)
        inflight = [r for r in self.running if not r.is_decoding] + self.loading
        newest_admitted = -1
        now = time.monotonic()
        for req in ordered:
            if len(self.running) + len(self.loading) >= self.config.max_running_requests:
                break
            if budget == 0 and self.source is None:
                break
            if self.kv.awaiting_pages(req, now):
                continue
            if req.grammar is not None and not req.grammar.ready:
                continue  # its grammar is still compiling: the others go ahead
            match = self.kv.match(req)
            if self.kv.reuses_prefixes and self._shares_inflight_prefix(
                req, match.device_len + match.host_len, inflight
            ):
                continue
            local = match.device_len + match.host_len
            if budget == 0 and not self._plan_load(req, local):
                continue  # only loads, which need no prefill budget, can start now
            self.kv.admit(req, match)
            output = self._reserved_output(req)
            chunk = self.kv.prefill_chunk(req, self.config.chunked_prefill_size, output)
            if not chunk or not self.kv.can_admit(req.num_uncomputed, output, reserved):
                self.kv.release(req)
                if not self.running and not self.loading and step.empty:
                    self.kv.unpin_for(req.num_uncomputed + output)  # it could never run
                break
            loaded = self.kv.load(req, match)  # the host-tier part, onto the device
            load = self._plan_load(req, req.kv.computed)
            if load:
                if not self.kv.extend(req, load):
                    self.kv.release(req)
                    break
                self._start_load(step, req, match.device_len, loaded)
            elif budget == 0:  # the estimate said load, the exact plan says compute: not now
                self.kv.release(req)
                continue
            else:
                n = self._chunk(req, min(budget, chunk))
                if n > budget and step.prefills:  # a segment prefill goes whole, in its own step
                    self.kv.release(req)
                    continue
                if not self.kv.extend(req, n):
                    self.kv.release(req)
                    break
                if self.kv.record_admission(req, match.device_len, loaded):
                    step.admitted.append(req)
                self.waiting.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                step.prefills.append((req, n))
                budget = max(budget - n, 0)
            reserved += self._future_need(req)
            inflight.append(req)
            newest_admitted = max(newest_admitted, req.arrival)
        for req in self.waiting:
            if req.arrival < newest_admitted:
                req.times_overtaken += 1

    def _chunk(self, req: Request, budget: int) -> int:
        """A request reusing RAG segments prefills its whole prompt in one sparse pass (most of
        it is copied, not computed); any other prefills at most ``budget`` tokens. A draft is
        computed in one step with the token before it, so it is cut to fit."""
        if req.num_draft and req.num_uncomputed > budget:
            req.trim_draft(max(req.num_draft - (req.num_uncomputed - budget), 0))
        if (
            self.kv.reuses_prefixes
            and req.segments
            and any(s >= req.num_computed for s, _ in req.segments)
        ):
            return req.num_uncomputed
        return min(budget, req.num_uncomputed)

    def _plan_load(self, req: Request, matched: int) -> int:
        if self.source is None or req.transfer.load_failed is not None:
            return 0
        return self.source.plan(req, matched)

    def _start_load(self, step: Step, req: Request, matched: int, loaded: int) -> None:
        if self.kv.record_admission(req, matched, loaded):
            step.admitted.append(req)
        self.waiting.remove(req)
        self.loading.append(req)
        req.status = RequestStatus.LOADING
        self.source.start(req)

    def _land_loads(self) -> None:
        if self.source is None:
            return
        for req, reason in self.source.poll():
            if req.status is not RequestStatus.LOADING:
                continue  # it finished (was aborted) meanwhile
            self.loading.remove(req)
            if reason is None:
                self.kv.commit(req, req.kv.allocated - req.kv.computed)
                self.kv.publish(req)  # the landed prefix joins the tree (and its events)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
            else:  # nothing leaks: release frees up to allocated; compute it here instead
                req.transfer.load_failed = reason
                self.kv.release(req)
                req.status = RequestStatus.WAITING
                self.waiting.append(req)

    def _shares_inflight_prefix(self, req: Request, matched: int, inflight: list[Request]) -> bool:
        for other in inflight:
            if other.namespace != req.namespace:
                continue
            shared = common_prefix_len(req.token_ids[:-1], other.token_ids)
            if shared - matched >= DEDUP_MIN_SHARED_TOKENS:
                return True
        return False

    # ------------------------------------------------------------------ leaving
    def _retract_newest(self) -> Request:
        victim = max(self.running, key=lambda r: r.arrival)
        victim.trim_draft()  # not computed: resuming drafts again
        self.kv.release(victim)
        self.running.remove(victim)
        victim.status = RequestStatus.WAITING
        victim.num_retractions += 1
        self.num_retractions += 1
        self.waiting.append(victim)
        self.new_token_ratio = max(self.new_token_ratio, RETRACT_NEW_TOKEN_RATIO)
        return victim

    def finish(self, req: Request, reason: str) -> None:
        if req.status is RequestStatus.LOADING:
            self.source.cancel(req)  # after this nothing lands in its slots
            self.kv.release(req)
            self.loading.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.kv.release(req)
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
