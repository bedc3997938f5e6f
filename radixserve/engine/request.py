"""Request: one sequence's tokens, KV slots and progress through the engine.

Token ids (prompt, then output) live in one int32 buffer sized for the request's whole life,
so appending is O(1) and the radix tree gets a zero-copy view. The request's KV slots and how
far they are cached, computed and allocated live in its ledger ``kv`` (a ``KVLedger``), which
only ``RequestKV`` writes; ``num_computed`` reads it.

A request may carry a *draft*: the ``num_draft`` last tokens, proposed by a draft source
(``drafts/``: the text its grammar forces, its own text, the cache's), which are computed in
the next step but count as output only once the sampler has checked that the model would
have drawn each of them; ``drafting`` is its drafting state (``drafts/policy.py``).

States: WAITING (no slots) -> RUNNING (prefilling while ``num_computed < num_tokens - 1``,
then decoding) -> FINISHED; a retracted request goes back to WAITING keeping its output.
A request whose KV comes from elsewhere (``kv_source.py``) is LOADING between admission and
RUNNING: it holds its slots but runs nothing until the KV has landed.

What the request is (ids, prompt, sampling, namespace, segments, prefill peer) is its frozen
``RequestSpec`` (``spec.py``), built once where the request enters. What the engine learns
while running it sits beside the spec, one object per concern: ``usage`` (what the cache gave
its prompt, the one declaration of those figures, also carried by every output), ``tier``
(a storage prefetch it waits for) and ``transfer`` (a failed KV load from a prefill peer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from radixserve.engine.kv_manager import KVLedger
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.spec import Namespace, RequestSpec


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Verified:
    """What a step made of a request's draft: how many of its tokens were kept, and their
    logprobs (when the request asks for logprobs)."""

    kept: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Usage:
    """What the cache did for one request's prompt; each output carries the latest."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # from every tier, at first admission; of which:
    host_cached_tokens: int = 0  # loaded back from the host tier
    storage_cached_tokens: int = 0  # fetched from the storage tier
    segment_hits: int = 0  # RAG segments found in the segment store
    reused_tokens: int = 0  # prompt tokens whose KV came from stored segments
    recomputed_tokens: int = 0  # reused segment tokens computed again (partial recompute)
    # the request was first admitted, its prompt matched against the cache: from then on
    # ``cached_tokens`` and its split are known (segment figures grow while it prefills)
    admitted: bool = False

    def cached_by_tier(self) -> dict[str, int]:
        """The prompt tokens served from the cache, split by the tier they came from."""
        lower = self.host_cached_tokens + self.storage_cached_tokens
        return {"device": self.cached_tokens - lower, "host": self.host_cached_tokens,
                "storage": self.storage_cached_tokens}  # fmt: skip

    def segment_usage(self) -> dict[str, int]:
        """What reusing RAG segments did for this prompt (all 0 without segments)."""
        return {"segment_hits": self.segment_hits, "reused_tokens": self.reused_tokens,
                "recomputed_tokens": self.recomputed_tokens}  # fmt: skip


@dataclass
class TierState:
    """A request's dealings with the lower cache tiers."""

    prefetch: Any = None  # a storage fetch it waits for before admission


@dataclass
class TransferState:
    """A request's dealings with a prefill peer (disaggregation)."""

    load_failed: str | None = None  # why loading its KV failed (then it computes it here)


class Request:
    def __init__(self, spec: RequestSpec, max_tokens: int, seed: int, arrival: int = 0):
        self.spec = spec
        self.params: SamplingParams = spec.params
        self.max_tokens = max_tokens  # resolved against the context limit
        self.arrival = arrival  # admission order key (monotonic counter)
        self.prompt_len = len(spec.prompt_ids)
        self._ids = np.empty(self.prompt_len + max_tokens, dtype=np.int32)
        self._ids[: self.prompt_len] = spec.prompt_ids
        self.num_tokens = self.prompt_len
        self.kv = KVLedger(self.prompt_len + max_tokens)
        self.usage = Usage(prompt_tokens=self.prompt_len)
        self.tier = TierState()
        self.transfer = TransferState()
        self.admitted_once = False
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.times_overtaken = 0
        self.num_retractions = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.logprobs: list[TokenLogprob] = []
        self.grammar: Any = None  # its GrammarState (structured/) when the spec has a grammar
        self.num_draft = 0  # trailing draft tokens, appended but not yet verified
        self.drafting: Any = None  # its RequestDrafting (drafts/policy.py) once it drew a token

    # ------------------------------------------------------------------ the spec
    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def namespace(self) -> Namespace:
        return self.spec.namespace

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        return self.spec.segments

    def add_usage(self, **changes: int | bool) -> None:
        """Record what the cache did for the prompt (``Usage`` is frozen: outputs share it)."""
        self.usage = replace(self.usage, **changes)

    # ------------------------------------------------------------------ tokens
    @property
    def token_ids(self) -> np.ndarray:
        return self._ids[: self.num_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self.prompt_len : self.num_tokens].tolist()

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    def append_token(self, token_id: int) -> None:
        self._ids[self.num_tokens] = token_id
        self.num_tokens += 1

    def append_tokens(self, token_ids: np.ndarray) -> None:
        n = len(token_ids)
        self._ids[self.num_tokens : self.num_tokens + n] = token_ids
        self.num_tokens += n

    def add_draft(self, token_ids: list[int]) -> None:
        """Append a draft of the next tokens; they are computed in the next step and kept as
        far as the model's own choice agrees (``settle_draft``)."""
        if self.num_draft:
            raise RuntimeError(f"{self!r} already has a draft")
        self.append_tokens(np.asarray(token_ids, dtype=np.int32))
        self.num_draft = len(token_ids)

    def settle_draft(self, accepted: int) -> None:
        """Keep the first ``accepted`` draft tokens as output and drop the rest."""
        if not 0 <= accepted <= self.num_draft:
            raise RuntimeError(f"{self!r}: {accepted} of {self.num_draft} draft tokens accepted")
        self.num_tokens -= self.num_draft - accepted
        self.num_draft = 0

    def trim_draft(self, keep: int = 0) -> None:
        """Drop all but the first ``keep`` draft tokens (not yet computed)."""
        keep = min(keep, self.num_draft)
        self.num_tokens -= self.num_draft - keep
        self.num_draft = keep

    # ------------------------------------------------------------------ progress
    @property
    def num_computed(self) -> int:
        return self.kv.computed

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.status is RequestStatus.RUNNING and self.num_uncomputed == 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def remaining_output(self) -> int:
        return self.max_tokens - self.num_output

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"{self.kv!r})"
        )
