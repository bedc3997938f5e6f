"""OpenAI response bodies and stream chunks, built from a finished or running ``Job``.

Usage counts the prompt once per prompt (not once per choice); ``cached_tokens`` is what the
first choice of each prompt got from the cache, over every tier, and the extension
``cached_tokens_by_tier`` splits it: ``device``, ``host`` (loaded back from the host tier),
``storage`` (fetched from the storage tier). With RAG segments (reusable content parts),
``segment_hits``, ``reused_tokens`` and ``recomputed_tokens`` say what reusing them did.
"""

from __future__ import annotations

from typing import Any

from radixserve.api.tool_stream import Text, ToolStream
from radixserve.api.tools import ToolPlan, openai_call
from radixserve.engine.request import TokenLogprob
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.chat_run import new_pieces
from radixserve.server.serving import Job


def usage(job: Job, num_prompts: int) -> dict[str, Any]:
    per_prompt = len(job.trackers) // num_prompts
    firsts = job.trackers[::per_prompt]
    prompt = sum(len(job.prompts[i * per_prompt]) for i in range(num_prompts))
    completion = sum(len(t.token_ids) for t in job.trackers)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(t.usage.cached_tokens for t in firsts),
            "cached_tokens_by_tier": tier_sum(t.usage.cached_by_tier() for t in firsts),
            **{k: sum(t.usage.segment_usage()[k] for t in firsts) for k in SEGMENT_USAGE},
        },
    }


SEGMENT_USAGE = ("segment_hits", "reused_tokens", "recomputed_tokens")  # RAG segments


def tier_sum(splits) -> dict[str, int]:
    total = {"device": 0, "host": 0, "storage": 0}
    for split in splits:
        for tier, n in split.items():
            total[tier] += n
    return total


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


def _envelope(job: Job, model: str, obj: str, choices: list[dict], **extra: Any) -> dict:
    return {
        "id": job.response_id,
        "object": obj,
        "created": job.created,
        "model": model,
        "choices": choices,
        **extra,
    }


def chat_message(text: str, finish_reason: str | None, tools: ToolPlan | None):
    """The assistant message of one choice, and its finish reason (``tool_calls`` when the
    output holds calls)."""
    if tools is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = tools.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def chat_response(
    job: Job, model: str, tokenizer: Tokenizer, want_logprobs: bool, tools: ToolPlan | None = None
) -> dict:
    choices = []
    for i, t in enumerate(job.trackers):
        message, reason = chat_message(t.text, t.finish_reason, tools)
        lp = chat_logprobs(tokenizer, t.logprobs) if want_logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
    return _envelope(job, model, "chat.completion", choices, usage=usage(job, 1))


def completion_response(
    job: Job, model: str, tokenizer: Tokenizer, want_logprobs: bool, num_prompts: int
) -> dict:
    choices = [
        {
            "index": i,
            "text": t.text,
            "logprobs": completion_logprobs(tokenizer, t.logprobs) if want_logprobs else None,
            "finish_reason": t.finish_reason,
        }
        for i, t in enumerate(job.trackers)
    ]
    return _envelope(job, model, "text_completion", choices, usage=usage(job, num_prompts))


class _Stream:
    """Chunk builders for a streamed response: ``chunks`` after each change of one choice,
    ``final`` once at the end (the usage chunk, when asked for)."""

    object_name = ""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        want_logprobs: bool,
        include_usage: bool,
        num_prompts: int = 1,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.num_prompts = num_prompts

    def _chunk(self, job: Job, choice: dict) -> dict:
        return _envelope(job, self.model, self.object_name, [choice])

    def final(self, job: Job) -> list[dict]:
        if not self.include_usage:
            return []
        return [
            _envelope(job, self.model, self.object_name, [], usage=usage(job, self.num_prompts))
        ]


class ChatStream(_Stream):
    """With ``tools``, a choice's text streams as content, and each tool call as one
    ``tool_calls`` delta (its arguments whole) once its block closed."""

    object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolPlan | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.started: set[int] = set()
        self.tools = tools
        self.parsers: dict[int, ToolStream] = {}  # per choice, with tools
        self.num_calls: dict[int, int] = {}

    def chunks(self, job: Job, index: int) -> list[dict]:
        t = job.trackers[index]
        out = []
        if index not in self.started:  # the first chunk of a choice names the role
            self.started.add(index)
            out.append(
                self._chunk(
                    job,
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    },
                )
            )
        if self.tools is not None:
            return out + self._tool_chunks(job, index)
        text, _, logprobs = t.take_stream_delta()
        if text or (self.want_logprobs and logprobs):
            lp = chat_logprobs(self.tokenizer, logprobs) if self.want_logprobs else None
            out.append(
                self._chunk(
                    job,
                    {
                        "index": index,
                        "delta": {"content": text},
                        "logprobs": lp,
                        "finish_reason": None,
                    },
                )
            )
        if t.finished:
            out.append(
                self._chunk(
                    job,
                    {
                        "index": index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": t.finish_reason,
                    },
                )
            )
        return out

    def _tool_chunks(self, job: Job, index: int) -> list[dict]:
        """Text as it comes and each call once whole (``api/tool_stream.py``)."""
        t = job.trackers[index]
        parser = self.parsers.setdefault(index, self.tools.stream())
        pieces = new_pieces(parser, t)
        deltas = []
        for piece in pieces:
            if isinstance(piece, Text):
                deltas.append({"content": piece.text})
                continue
            k = self.num_calls[index] = self.num_calls.get(index, 0) + 1
            deltas.append({"tool_calls": [{"index": k - 1, **openai_call(piece)}]})
        choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
                   for d in deltas]  # fmt: skip
        if t.finished:
            reason = "tool_calls" if self.num_calls.get(index) else t.finish_reason
            choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return [self._chunk(job, c) for c in choices]


class CompletionStream(_Stream):
    object_name = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.offsets: dict[int, int] = {}  # characters streamed per choice, for text_offset

    def chunks(self, job: Job, index: int) -> list[dict]:
        t = job.trackers[index]
        text, _, logprobs = t.take_stream_delta()
        if not text and not t.finished and not (self.want_logprobs and logprobs):
            return []
        offset = self.offsets.get(index, 0)
        lp = completion_logprobs(self.tokenizer, logprobs, offset) if self.want_logprobs else None
        self.offsets[index] = offset + len(text)
        reason = t.finish_reason if t.finished else None
        return [
            self._chunk(
                job, {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
            )
        ]
