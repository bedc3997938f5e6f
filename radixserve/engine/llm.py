"""The offline API: ``LLM(model=None, **engine_options).generate(...)`` and ``.chat(...)``.

Prompts are strings or token-id lists; conversations are lists of ``{"role", "content"}``
messages rendered with the model's chat template. All requests of one call are queued at
once and run with continuous batching; outputs come back in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from radixserve.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.output import OutputTracker
from radixserve.engine.request import TokenLogprob
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model import LoadedModel

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    cached_tokens: int
    finish_reason: str | None
    logprobs: list[TokenLogprob]


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) for t in x) and len(x) > 0


class LLM:
    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None,
                 **engine_options: Any):  # fmt: skip
        self.config = EngineConfig.from_options(model=model, **engine_options)
        self.engine = Engine(self.config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:  # fmt: skip
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        encoded = []
        for p in prompts:
            if isinstance(p, str):
                encoded.append((p, self.tokenizer.encode(p)))
            elif _is_token_ids(p):
                encoded.append((None, list(p)))
            else:
                raise ValueError("each prompt must be a string or a non-empty list of token ids")
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(self, conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:  # fmt: skip
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        encoded = []
        for messages in conversations:
            text = self.tokenizer.render_chat(list(messages))
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, sampling_params, use_tqdm)

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:  # fmt: skip
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(encoded)
        else:
            params = list(sampling_params)
            if len(params) != len(encoded):
                raise ValueError(f"{len(params)} sampling params for {len(encoded)} prompts")
        trackers: dict[str, OutputTracker] = {}
        order = []
        try:
            for (_, ids), p in zip(encoded, params, strict=True):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, ids, p)
                trackers[rid] = OutputTracker(rid, self.tokenizer, p)
                order.append(rid)
        except ValueError:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="generating")
        pending = set(order)
        while pending:
            for out in self.engine.step():
                tracker = trackers[out.request_id]
                if tracker.update(out):
                    self.engine.abort_request(out.request_id, reason="stop")
                if tracker.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return [
            RequestOutput(
                request_id=rid, prompt=prompt, prompt_token_ids=ids, text=t.text,
                token_ids=t.token_ids, cached_tokens=t.cached_tokens,
                finish_reason=t.finish_reason, logprobs=t.logprobs,
            )
            for rid, (prompt, ids) in zip(order, encoded, strict=True)
            for t in [trackers[rid]]
        ]  # fmt: skip
