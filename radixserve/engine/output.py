"""From engine token deltas to text: incremental detokenization and stop strings.

Shared by the offline ``LLM`` and the HTTP server. ``IncrementalDetokenizer`` emits only
complete characters (a multi-byte character split over tokens waits for its last byte).
``OutputTracker`` accumulates one request's text and tokens, ends it at the first stop string
(the caller then aborts the request in the engine with reason ``stop``), and for streaming
holds back the last ``len(longest stop) - 1`` characters, which could begin a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.engine.core import StepOutput
from radixserve.engine.request import TokenLogprob, Usage
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            # the tokens just read stay as context, so word-initial spaces decode right
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""


@dataclass
class OutputTracker:
    request_id: str
    tokenizer: Tokenizer
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended the output, if one did
    usage: Usage = field(default_factory=Usage)  # the latest output's
    streamed_chars: int = 0
    streamed_tokens: int = 0

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(self.tokenizer, self.params.skip_special_tokens)
        self.holdback = max((len(s) for s in self.params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def admitted(self) -> bool:
        """The engine admitted the request: ``usage`` holds its cache hit."""
        return self.usage.admitted

    def update(self, out: StepOutput) -> bool:
        """Take one engine delta; True if a stop string just ended the request."""
        if self.finished:
            return False
        self.usage = out.usage
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        start = max(0, len(self.text) - self.holdback)
        self.text += self.detokenizer.push(out.new_token_ids, final=out.finished)
        if self.params.stop and self._cut_at_stop(start):
            self.finish_reason = "stop"
            return True
        if out.finished:
            self.finish_reason = out.finish_reason
        return False

    def _cut_at_stop(self, start: int) -> bool:
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        self.stop_string = stop
        self.text = self.text[: pos + (len(stop) if self.params.include_stop_str_in_output else 0)]
        return True

    def take_stream_delta(self) -> tuple[str, list[int], list[TokenLogprob]]:
        """Text, tokens and logprobs not yet streamed (text held back near a possible stop)."""
        end = len(self.text) if self.finished else max(0, len(self.text) - self.holdback)
        end = max(end, self.streamed_chars)
        text = self.text[self.streamed_chars : end]
        tokens = self.token_ids[self.streamed_tokens :]
        logprobs = self.logprobs[self.streamed_tokens :]
        self.streamed_chars = end
        self.streamed_tokens = len(self.token_ids)
        return text, tokens, logprobs
