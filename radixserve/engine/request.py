"""Request: one sequence's tokens, KV slots and progress through the engine.

Token ids (prompt, then output) live in one int32 buffer sized for the request's whole life,
so appending is O(1) and the radix tree gets a zero-copy view. The request's KV slots and how
far they are cached, computed and allocated live in its ledger ``kv`` (a ``KVLedger``), which
only ``RequestKV`` writes; ``num_computed`` reads it.

States: WAITING (no slots) -> RUNNING (prefilling while ``num_computed < num_tokens - 1``,
then decoding) -> FINISHED; a retracted request goes back to WAITING keeping its output.
A request whose KV comes from elsewhere (``kv_source.py``) is LOADING between admission and
RUNNING: it holds its slots but runs nothing until the KV has landed.

Disaggregation: on a decode instance ``prefill_peer`` names the prefill instance to take the
prompt's KV from (None: compute it here); on a prefill instance ``prefill_only`` marks a
request that computes its prompt's KV for a decode instance and ends there, sampling nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.engine.kv_manager import KVLedger
from radixserve.engine.sampling_params import SamplingParams


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


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int] | np.ndarray,
        params: SamplingParams,
        max_tokens: int,
        seed: int,
        extra_key: Any = None,
        arrival: int = 0,
        segments: list[tuple[int, int]] | None = None,
        recompute_ratio: float | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.max_tokens = max_tokens  # resolved against the context limit
        self.extra_key = extra_key
        self.arrival = arrival  # admission order key (monotonic counter)
        self.prompt_len = len(prompt_ids)
        self._ids = np.empty(self.prompt_len + max_tokens, dtype=np.int32)
        self._ids[: self.prompt_len] = prompt_ids
        self.num_tokens = self.prompt_len
        self.kv = KVLedger(self.prompt_len + max_tokens)
        self.cached_tokens = 0  # prompt tokens served from the cache at first admission
        self.host_cached_tokens = 0  # ... of which loaded back from the host tier
        self.storage_cached_tokens = 0  # ... of which fetched from the storage tier
        self.prefetch: Any = None  # a storage fetch it waits for before admission
        self.admitted_once = False
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.times_overtaken = 0
        self.num_retractions = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.logprobs: list[TokenLogprob] = []
        self.prefill_peer: str | None = None
        self.prefill_only = False
        self.load_failed: str | None = None  # why loading its KV failed (then it computes it)
        # reusable prompt ranges (RAG segments, see segments.py) and what reusing them did
        self.segments = [tuple(x) for x in segments] if segments else []
        self.recompute_ratio = recompute_ratio  # None: the engine's default
        self.segment_hits = 0
        self.segment_reused_tokens = 0
        self.segment_recomputed_tokens = 0

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
