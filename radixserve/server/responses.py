"""OpenAI response bodies and stream chunks, built from a finished or running ``Job``.

Usage counts the prompt once per prompt (not once per choice); ``cached_tokens`` is what the
first choice of each prompt got from the cache.
"""

from __future__ import annotations

from typing import Any

from radixserve.engine.request import TokenLogprob
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.serving import Job

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def usage(job: Job, num_prompts: int) -> dict[str, Any]:
    per_prompt = len(job.trackers) // num_prompts
    firsts = job.trackers[::per_prompt]
    prompt = sum(len(job.prompts[i * per_prompt]) for i in range(num_prompts))
    completion = sum(len(t.token_ids) for t in job.trackers)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(t.cached_tokens for t in firsts)},
    }


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: list[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    tokens = [_token_text(tokenizer, lp.token_id) for lp in logprobs]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_response(job: Job, model: str, tokenizer: Tokenizer, want_logprobs: bool) -> dict:
    choices = []
    for i, t in enumerate(job.trackers):
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": t.text},
                "logprobs": chat_logprobs(tokenizer, t.logprobs) if want_logprobs else None,
                "finish_reason": FINISH_REASONS.get(t.finish_reason, t.finish_reason),
            }
        )
    return {
        "id": job.response_id,
        "object": "chat.completion",
        "created": job.created,
        "model": model,
        "choices": choices,
        "usage": usage(job, 1),
    }


def completion_response(
    job: Job, model: str, tokenizer: Tokenizer, want_logprobs: bool, num_prompts: int
) -> dict:
    choices = []
    for i, t in enumerate(job.trackers):
        choices.append(
            {
                "index": i,
                "text": t.text,
                "logprobs": completion_logprobs(tokenizer, t.logprobs) if want_logprobs else None,
                "finish_reason": FINISH_REASONS.get(t.finish_reason, t.finish_reason),
            }
        )
    return {
        "id": job.response_id,
        "object": "text_completion",
        "created": job.created,
        "model": model,
        "choices": choices,
        "usage": usage(job, num_prompts),
    }


class ChatStream:
    """Chunk builders for a streamed chat completion."""

    def __init__(self, model: str, tokenizer: Tokenizer, want_logprobs: bool, include_usage: bool):
        self.model, self.tokenizer = model, tokenizer
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.started: set[int] = set()

    def _chunk(self, job: Job, choices: list[dict], **extra: Any) -> dict:
        return {
            "id": job.response_id,
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def chunks(self, job: Job, index: int) -> list[dict]:
        t = job.trackers[index]
        out = []
        if index not in self.started:
            self.started.add(index)
            out.append(
                self._chunk(
                    job,
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                )
            )
        text, _, logprobs = t.take_stream_delta()
        if text or (self.want_logprobs and logprobs):
            lp = chat_logprobs(self.tokenizer, logprobs) if self.want_logprobs else None
            out.append(
                self._chunk(
                    job,
                    [
                        {
                            "index": index,
                            "delta": {"content": text},
                            "logprobs": lp,
                            "finish_reason": None,
                        }
                    ],
                )
            )
        if t.finished:
            reason = FINISH_REASONS.get(t.finish_reason, t.finish_reason)
            out.append(
                self._chunk(
                    job, [{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}]
                )
            )
        return out

    def final(self, job: Job) -> list[dict]:
        return [self._chunk(job, [], usage=usage(job, 1))] if self.include_usage else []


class CompletionStream:
    """Chunk builders for a streamed text completion."""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        want_logprobs: bool,
        include_usage: bool,
        num_prompts: int,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.num_prompts = num_prompts
        self.offsets: dict[int, int] = {}

    def _chunk(self, job: Job, choices: list[dict], **extra: Any) -> dict:
        return {
            "id": job.response_id,
            "object": "text_completion",
            "created": job.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def chunks(self, job: Job, index: int) -> list[dict]:
        t = job.trackers[index]
        text, _, logprobs = t.take_stream_delta()
        if not text and not t.finished and not (self.want_logprobs and logprobs):
            return []
        lp = None
        if self.want_logprobs:
            lp = completion_logprobs(self.tokenizer, logprobs, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        reason = FINISH_REASONS.get(t.finish_reason, t.finish_reason) if t.finished else None
        return [
            self._chunk(
                job, [{"index": index, "text": text, "logprobs": lp, "finish_reason": reason}]
            )
        ]

    def final(self, job: Job) -> list[dict]:
        if not self.include_usage:
            return []
        return [self._chunk(job, [], usage=usage(job, self.num_prompts))]
