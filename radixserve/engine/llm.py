"""The offline API: ``LLM(model=None, **engine_options).generate(...)`` and ``.chat(...)``.

Prompts are strings or token-id lists; conversations are lists of ``{"role", "content"}``
messages rendered with the model's chat template. All requests of one call are queued at
once and run with continuous batching; outputs come back in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
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
    def __init__(
        self, model: str | None = None, *, loaded: LoadedModel | None = None, **engine_options: Any
    ):
        self._attach(Engine(EngineConfig.from_options(model=model, **engine_options), loaded))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls.from_engine(Engine(config))

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """An LLM front end over an engine that already exists (tests, benchmarks)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def close(self) -> None:
        """Finish pending writes to a storage tier (a later run reuses them) and stop its
        threads; without one, nothing to do."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _attach(self, engine: Engine) -> None:
        self.engine, self.config, self.tokenizer = engine, engine.config, engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
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

    def chat(
        self,
        conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        encoded = []
        for messages in conversations:
            text = self.tokenizer.render_chat(list(messages))
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, sampling_params, use_tqdm)

    def stream(
        self, prompt: Prompt | list[dict[str, Any]], sampling_params: SamplingParams | None = None
    ) -> Iterator[tuple[str, OutputTracker]]:
        """Run one prompt (text, token ids or chat messages); after each engine step that
        touched it, yield the new text (maybe empty) and the request's tracker."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.encode_chat(prompt)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        [(_, tracker)] = self._submit([ids], [sampling_params or SamplingParams()])
        for _ in self._drive({tracker.request_id: tracker}):
            yield tracker.take_stream_delta()[0], tracker

    def _submit(
        self, token_lists: list[list[int]], params: list[SamplingParams]
    ) -> list[tuple[str, OutputTracker]]:
        submitted: list[tuple[str, OutputTracker]] = []
        try:
            for ids, p in zip(token_lists, params, strict=True):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, ids, p)
                submitted.append((rid, OutputTracker(rid, self.tokenizer, p)))
        except ValueError:
            for rid, _ in submitted:
                self.engine.abort_request(rid)
            raise
        return submitted

    def _drive(self, trackers: dict[str, OutputTracker]) -> Iterator[OutputTracker]:
        """Step the engine until every tracked request ends; yield trackers as they change."""
        pending = set(trackers)
        while pending:
            for out in self.engine.step():
                tracker = trackers.get(out.request_id)
                if tracker is None:
                    continue
                if tracker.update(out):
                    self.engine.abort_request(out.request_id, reason="stop")
                if tracker.finished:
                    pending.discard(out.request_id)
                yield tracker

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(encoded)
        else:
            params = list(sampling_params)
            if len(params) != len(encoded):
                raise ValueError(f"{len(params)} sampling params for {len(encoded)} prompts")
        submitted = self._submit([ids for _, ids in encoded], params)
        trackers = dict(submitted)
        with tqdm(total=len(submitted), disable=not use_tqdm, desc="generating") as bar:
            for tracker in self._drive(trackers):
                if tracker.finished:  # a request ends once: no outputs follow its last
                    bar.update(1)
        return [
            RequestOutput(
                request_id=rid,
                prompt=prompt,
                prompt_token_ids=ids,
                text=t.text,
                token_ids=t.token_ids,
                cached_tokens=t.usage.cached_tokens,
                finish_reason=t.finish_reason,
                logprobs=t.logprobs,
            )
            for (rid, t), (prompt, ids) in zip(submitted, encoded, strict=True)
        ]
