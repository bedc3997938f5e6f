"""EngineCore: the model-free half of an engine, shared by the server and the simulator.

The core owns the request registry, the scheduler and, through ``RequestKV``, every
request's KV ledger. It never runs a model: an *executor* does (``ModelExecutor`` in
``executor.py``, the simulator's ``TimingExecutor``). One step is::

    step = core.schedule()               which requests run, and how many tokens each
                                         (and which were first admitted: their cache hit)
    result = executor.run(step)          compute (or time) them; draw the next tokens
    outputs = core.postprocess(step, result)
                                         commit what was computed, publish finished prefill
                                         chunks to the tree, append the drawn tokens, stop
                                         and finish requests, one StepOutput per change
                                         (a request just admitted gets one without tokens)

so whatever runs the step, the bookkeeping is this one. Features that need to act around
it (KV transfer, the step trace) attach as ``Feature`` hooks (``hooks.py``). With draft
sources (``drafts/``: the text a grammar forces, the request's own text, the cache's), a
request that goes on may get a draft of its next tokens appended after its step; the step
that computes it keeps what the sampler verified, commits that KV and frees the rest.

``add`` validates a ``RequestSpec`` (clear ``ValueError``s for empty, out-of-vocabulary,
too-long or pool-exceeding prompts); a failed request (``fail``) and an aborted one
(``abort``) hand their slots back through their ledgers, so nothing leaks whatever fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.config import EngineConfig
from radixserve.engine.drafts import Drafts
from radixserve.engine.hooks import Feature
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.kv_source import KVSource
from radixserve.engine.request import Request, RequestStatus, TokenLogprob, Usage, Verified
from radixserve.engine.scheduler import Scheduler, Step
from radixserve.engine.spec import RequestSpec

# What an executor drew for one request: the token and its logprob (None unless asked), or
# the exception sampling its row raised.
Drawn = tuple[int, TokenLogprob | None] | Exception


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    usage: Usage  # what the cache did for the prompt so far
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None  # with finish_reason "error": a short message for the client


@dataclass
class StepResult:
    """What an executor did with a step: the tokens drawn (in the order to report them) and
    the requests whose computation failed (nothing of theirs is committed)."""

    sampled: list[tuple[Request, Drawn]] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    # request id -> what it keeps of its draft (requests with a draft)
    verified: dict[str, Verified] = field(default_factory=dict)


@dataclass(frozen=True)
class Limits:
    """What requests are checked against: the context, the vocabulary (None: any token id)
    and the tokens that end a request unless it ignores them."""

    max_model_len: int
    vocab_size: int | None = None
    eos_token_ids: frozenset[int] = frozenset()


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        kv: RequestKV,
        limits: Limits,
        source: KVSource | None = None,
        features: Iterable[Feature] = (),
        drafts: Drafts | None = None,
    ):
        """``drafts``: the draft sources and their policy (None: no drafts)."""
        self.config, self.kv, self.limits = config, kv, limits
        self.scheduler = Scheduler(config.scheduler, kv, source)
        self.drafts = drafts
        self.features = list(features)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        for f in self.features:
            f.attach(self)

    # ------------------------------------------------------------------ requests
    def add(self, spec: RequestSpec) -> Request:
        """Validate and queue a request (``ValueError`` naming what is wrong)."""
        if spec.prefill_peer is not None and self.scheduler.source is None:
            raise ValueError("a prefill instance was named but this is not a decode instance")
        spec.check()
        for f in self.features:
            f.check(spec)
        if spec.request_id in self.requests:
            raise ValueError(f"request id {spec.request_id!r} is already in use")
        max_tokens = self._check_lengths(
            spec.prompt_ids, spec.params.max_tokens, spec.params.logit_bias
        )
        seed = spec.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        req = Request(spec, max_tokens, seed, arrival=next(self._arrivals))
        self.requests[spec.request_id] = req
        self.scheduler.add(req)
        return req

    def _check_lengths(self, prompt_ids, asked: int | None, bias: dict[int, float]) -> int:
        """Check the prompt against the limits and the pool; return the output limit."""
        n, limit, vocab = len(prompt_ids), self.limits.max_model_len, self.limits.vocab_size
        if n == 0:
            raise ValueError("the prompt is empty")
        if vocab is not None and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if vocab is not None and bias and max(bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if n >= limit:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context is {limit} "
                "tokens, which must also hold at least one output token"
            )
        capacity = self.kv.capacity()
        max_tokens = min(limit, capacity) - n if asked is None else asked
        if asked is not None and n + max_tokens > limit:
            raise ValueError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {limit} tokens"
            )
        page = self.kv.page_size
        if max_tokens < 1 or -(-(n + max_tokens) // page) > capacity // page:
            raise ValueError(
                f"this request needs up to {n + max(max_tokens, 1)} KV slots (prompt {n} + "
                f"max_tokens {max_tokens}) but the KV pool holds only {capacity}; lower "
                "max_tokens or give the pool more memory (max_total_tokens / kv_cache_memory)"
            )
        return max_tokens

    def abort(self, request_id: str, reason: str = "abort") -> StepOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, reason)
        return self._output(req, [], [])

    def fail(self, req: Request, error: Exception) -> StepOutput:
        """End ``req`` with ``finish_reason="error"`` (the traceback is the caller's to log)."""
        self._finish(req, "error", type(error).__name__)
        out = self._output(req, [], [])
        out.error = f"internal error while generating ({type(error).__name__})"
        return out

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        for f in self.features:
            f.on_finish(req, reason, error)

    def has_unfinished(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or s.loading)

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.scheduler.running + self.scheduler.loading)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> Step:
        for f in self.features:
            f.before_schedule()
        step = self.scheduler.schedule()
        for f in self.features:
            f.after_schedule(step)
        return step

    def postprocess(self, step: Step, result: StepResult) -> list[StepOutput]:
        """Commit, publish, append, stop, finish (see the module docstring)."""
        outputs = [self.fail(r, e) for r, e in result.failed]
        kv, running = self.kv, RequestStatus.RUNNING
        for r in step.decodes:
            if r.status is running:
                kv.commit(r, 1)
        for r, n in step.prefills:
            if r.status is running:
                if r.num_draft:  # computed all, keeps what the model agreed with
                    v = result.verified.get(r.request_id)
                    kept = v.kept if v is not None else 0
                    if self.drafts is not None:
                        self.drafts.verified(r, r.num_draft, kept)
                    dropped = r.num_draft - kept
                    r.settle_draft(kept)
                    kv.commit(r, n - dropped)
                    kv.trim(r)
                else:
                    kv.commit(r, n)
                kv.publish(r)
        for f in self.features:
            f.after_forward(step)
        batch = len(self.scheduler.running)
        for r, drawn in result.sampled:
            if isinstance(drawn, Exception):
                outputs.append(self.fail(r, drawn))
                continue
            token, logprob = drawn
            v = result.verified.get(r.request_id)
            kept = r.output_ids[-v.kept :] if v is not None and v.kept else []
            logprobs = [*(v.logprobs if v is not None else []), *([logprob] if logprob else [])]
            r.append_token(token)
            r.logprobs += logprobs
            reason = self._stop_reason(r, token)
            if reason is not None:
                self._finish(r, reason)
            elif self.drafts is not None:
                self.drafts.after_tokens(r, [*kept, token], batch)
            outputs.append(self._output(r, [*kept, token], logprobs))
        return outputs + self.admissions(step, outputs)

    def admissions(self, step: Step, outputs: Iterable[StepOutput] = ()) -> list[StepOutput]:
        """An output without tokens for each request first admitted in ``step`` that has
        none among ``outputs``: its cache hit is known from admission, not from its first
        token, which a long prompt's prefill puts many steps later."""
        said = {o.request_id for o in outputs}
        return [self._output(r, [], []) for r in step.admitted
                if r.request_id not in said and not r.is_finished]  # fmt: skip

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if (not p.ignore_eos and token in self.limits.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if req.grammar is not None and req.grammar.terminated:
            return "stop"  # the grammar is complete
        if req.num_output >= req.max_tokens:
            return "length"
        return None

    def _output(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob]) -> StepOutput:
        finished = req.status is RequestStatus.FINISHED
        return StepOutput(req.request_id, tokens, finished, req.finish_reason, req.usage, logprobs)

    # ------------------------------------------------------------------ decode runs
    def decode_run_length(self, limit: int) -> int:
        """How many pure-decode steps ``advance_decodes`` may apply at once (0: none): nobody
        waits or loads, every running request decodes and has an output, none finishes
        before the last, and the memory obtainable now holds them (each request may need
        one page more than its slots). At most ``limit``."""
        s = self.scheduler
        if s.waiting or s.loading or not s.running:
            return 0
        if not all(r.is_decoding and r.num_output for r in s.running):
            return 0
        batch = len(s.running)
        k = min(limit, min(r.remaining_output for r in s.running))
        return max(min(k, (self.kv.available() - batch * self.kv.page_size) // batch), 0)

    def advance_decodes(
        self, k: int, tokens: Callable[[Request, int], np.ndarray]
    ) -> list[StepOutput]:
        """Apply ``k`` (from ``decode_run_length``) decode steps in one go, as ``k`` steps of
        ``schedule -> run -> postprocess`` would: ``tokens(req, k)`` are the tokens drawn.
        Only for requests that stop by length alone (the simulator's)."""
        running = list(self.scheduler.running)
        for r in running:
            if not self.kv.extend(r, k):  # cannot happen: k was bounded by what was obtainable
                raise RuntimeError(f"{r!r}: a planned decode run found no memory")
            self.kv.commit(r, k)
        self.scheduler.decay(k)
        outputs = []
        for r in running:
            new = tokens(r, k)
            r.append_tokens(new)
            if r.num_output >= r.max_tokens:
                self._finish(r, "length")
            outputs.append(self._output(r, new.tolist(), []))
        return outputs
