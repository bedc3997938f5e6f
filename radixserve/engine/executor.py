"""ModelExecutor: runs a scheduled step on the model (the core's bookkeeping is not here).

``run(step)`` computes the step's tokens over the paged KV pool and draws the next token of
every request that samples (``Step.sampling``); ``EngineCore.postprocess`` then commits what
was computed. A prefill that reuses RAG segments takes another strategy: it runs alone, as
one sparse forward over its whole context (``SegmentBlender.prefill``); every other request
of the step shares one batched forward.

Failures stay with the requests they hit: if a segment prefill raises, its request fails;
if the batched forward raises, every request of the step fails; if sampling the batch
raises, each row is sampled alone and only the rows that raise fail. The tracebacks go to
the log, never to a client.
"""

from __future__ import annotations

import logging

import torch

from radixserve.engine.core import Drawn, StepResult
from radixserve.engine.request import Request, Verified
from radixserve.engine.sampler import sample
from radixserve.engine.scheduler import Step
from radixserve.engine.segments import SegmentBlender
from radixserve.model import build_forward_batch, native_decode

log = logging.getLogger("radixserve")


class ModelExecutor:
    def __init__(self, model, pool, segments: SegmentBlender):
        self.model, self.pool, self.segments = model, pool, segments

    def run(self, step: Step) -> StepResult:
        result = StepResult()
        blended, logits = self._blend(step, result)
        done = {r.request_id for r, _ in result.failed} | {r.request_id for r in blended}
        prefills = [(r, n) for r, n in step.prefills if r.request_id not in done]
        # a draft and the token before it run as decode rows, one per token (a step
        # of decode rows only is one native call), not as a prefill chunk
        drafted = [r for r, n in prefills if r.num_draft and n == 1 + r.num_draft]
        prefills = [(r, n) for r, n in prefills if not (r.num_draft and n == 1 + r.num_draft)]
        decodes = step.decodes + drafted
        try:
            if decodes or prefills:
                logits.insert(0, self._forward(decodes, prefills))
        except Exception as e:
            log.exception("the forward pass failed; failing the requests of this step")
            failed = decodes + [r for r, _ in prefills] + blended
            result.failed += [(r, e) for r in failed]
            return result
        # in the order of the logits rows: decodes (with drafts), prefills, blended
        sampling = decodes + Step(prefills=prefills).sampling() + blended
        if sampling:
            logits = torch.cat(logits) if len(logits) > 1 else logits[0]
            drawn = self.sample(logits, sampling, result.verified)
            result.sampled = list(zip(sampling, drawn, strict=True))
        return result

    def _blend(self, step: Step, result: StepResult) -> tuple[list[Request], list[torch.Tensor]]:
        """Run each prefill that reuses RAG segments alone; return those done, their logits
        (its failures go to ``result``)."""
        done, logits = [], []
        for r, n in step.prefills:
            if not self.segments.applies(r, n):
                continue
            try:
                logits.append(self.segments.prefill(r))
                done.append(r)
            except Exception as e:
                log.exception("a segment prefill failed; failing its request")
                result.failed.append((r, e))
        return done, logits

    def _forward(self, decodes: list[Request], prefills: list[tuple[Request, int]]):
        """The step's logits. Where the model runs decode rows in one native call, a step
        with prompt chunks too runs its decode rows apart, natively: a row's logits then do
        not depend on whether a chunk shares its step (in bfloat16 the op-by-op path rounds
        them otherwise), so a draft verified beside a prompt chunk still gives what decoding
        its tokens one step each gives."""
        if decodes and prefills and native_decode.for_model(self.model) is not None:
            return torch.cat([self._pack(decodes, []), self._pack([], prefills)])
        return self._pack(decodes, prefills)

    def _pack(self, decodes: list[Request], prefills: list[tuple[Request, int]]):
        """Logits rows: each decode's (``1 + num_draft`` of a request with a draft: the row
        after the token before the draft and after each draft token), then the prefills'."""
        decode = [
            (int(r.token_ids[p]), p, r.kv.slots[: p + 1])
            for r in decodes
            for p in range(r.num_computed, r.num_tokens)
        ]
        prefill = [
            (
                torch.from_numpy(r.token_ids[r.num_computed : r.num_computed + n]),
                r.num_computed,
                r.kv.slots[: r.num_computed + n],
                # a chunk that ends the sequence gives logits at its last token (and at the
                # token before each draft token, were a draft computed as a chunk)
                1 + r.num_draft
                if r.num_computed + n == r.num_tokens and not r.spec.prefill_only
                else 0,
            )
            for r, n in prefills
        ]
        batch = build_forward_batch(
            decode, prefill, self.model.device, self.pool.pad_slot, decode_sequences=len(decodes)
        )
        return self.model.forward(batch, self.pool)

    def sample(
        self, logits: torch.Tensor, reqs: list[Request], verified: dict[str, Verified]
    ) -> list[Drawn]:
        """One ``(token, logprob)`` per request, or the exception its rows raised; what each
        request with a draft keeps of it goes to ``verified``."""
        try:
            return list(sample(logits, reqs, verified))
        except Exception:
            log.exception("sampling a batch failed; sampling its rows one by one")
        drawn: list[Drawn] = []
        # Each request draws from its own generator, so a row sampled alone gets what it would
        # have got in the batch (unless the failed batch call had already advanced it).
        at = 0
        for r in reqs:
            rows = 1 + r.num_draft
            try:
                drawn.append(sample(logits[at : at + rows], [r], verified)[0])
            except Exception as e:
                drawn.append(e)
            at += rows
        return drawn
