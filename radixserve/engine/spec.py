"""RequestSpec: what one engine request is, built once where it enters and never changed.

The HTTP front end (or the offline ``LLM``, or a prefill instance serving a decode peer)
builds one ``RequestSpec`` per engine request; it crosses the process boundary as a typed
msgpack message (``server/messages.py``) and the engine's ``Request`` holds it unchanged
beside its running state. The engine validates it on ``Engine.add`` (a clear ``ValueError``
per field), since a decoded message is only as good as its sender.

``namespace`` is the tenant's cache namespace (the API's ``cache_salt``, hashed): requests in
different namespaces never share cached tokens. ``None`` is the shared namespace.
``grammar`` constrains the output (``structured/``); the edge has checked that it parses.
``pins`` are prompt prefixes to keep on the device once computed (``engine/pin_requests.py``),
counted against ``tenant``'s pin budget.
"""

from __future__ import annotations

import msgspec

from radixserve.cache.base import Namespace
from radixserve.cache.pins import MAX_PIN_TTL_S
from radixserve.engine.sampling_params import SamplingParams
from radixserve.structured import GRAMMAR_KINDS

__all__ = ["Namespace", "RequestSpec"]

MAX_PINS = 4  # pins a request may ask for (Anthropic's limit of cache breakpoints)


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_ids: list[int]  # (in-process callers may pass an int32 array: it is only read)
    params: SamplingParams
    namespace: str | None = None
    # reusable prompt ranges, sorted and disjoint (RAG segments, engine/segments.py)
    segments: tuple[tuple[int, int], ...] = ()
    recompute_ratio: float | None = None  # of the reused segment tokens; None: the default
    # disaggregation: on a decode instance, the prefill instance that computes the prompt's KV
    # ("local": compute it here); on a prefill instance, a request that only computes KV for a
    # decode peer and samples nothing
    prefill_peer: str | None = None
    prefill_only: bool = False
    # constrained decoding: (kind, text), kinds in structured/'s GRAMMAR_KINDS
    grammar: tuple[str, str] | None = None
    # prefixes to pin on the device once computed (cache/pins.py): (prompt tokens, ttl in
    # seconds), and whose pin budget they count against (None: the shared one)
    pins: tuple[tuple[int, float], ...] = ()
    tenant: str | None = None

    def check(self) -> None:
        """``ValueError`` naming the field that is not what its type says (the lengths are
        the engine's to check, ``EngineCore.add``)."""
        if not isinstance(self.params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        self.params.validate()  # again: decoded params are only as good as their sender
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise ValueError(f"the namespace must be a string, got {self.namespace!r}")
        if self.segments:
            validate_segments(self.segments, len(self.prompt_ids))
        if self.recompute_ratio is not None:
            validate_ratio(self.recompute_ratio)
        if self.grammar is not None:
            kind, text = self.grammar
            if kind not in GRAMMAR_KINDS or not isinstance(text, str):
                raise ValueError(f"a grammar is (kind, text), kind one of {GRAMMAR_KINDS}")
        if self.pins:
            validate_pins(self.pins, len(self.prompt_ids))

    def with_prompt(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        """This spec's options for another prompt (one HTTP request fans out to several)."""
        return msgspec.structs.replace(
            self, request_id=request_id, prompt_ids=prompt_ids, params=params
        )


def validate_segments(segments, prompt_len: int) -> None:
    prev_end = 0
    for seg in segments:
        if not (isinstance(seg, tuple | list) and len(seg) == 2):
            raise ValueError(f"a segment is a (start, end) token range, got {seg!r}")
        start, end = seg
        if not (isinstance(start, int) and isinstance(end, int)):
            raise ValueError(f"segment bounds must be integers, got {seg!r}")
        if not prev_end <= start < end <= prompt_len:
            raise ValueError(
                f"segment {tuple(seg)} is empty, overlaps the one before or leaves the prompt "
                f"({prompt_len} tokens); segments are sorted, disjoint (start, end) ranges"
            )
        prev_end = end


def validate_pins(pins, prompt_len: int) -> None:
    if len(pins) > MAX_PINS:
        raise ValueError(f"at most {MAX_PINS} pins a request, got {len(pins)}")
    for pin in pins:
        if not (isinstance(pin, tuple | list) and len(pin) == 2):
            raise ValueError(f"a pin is (prompt tokens, ttl seconds), got {pin!r}")
        end, ttl = pin
        if isinstance(end, bool) or not isinstance(end, int) or not 0 < end <= prompt_len:
            raise ValueError(
                f"a pin's end must be within the prompt (1..{prompt_len}), got {end!r}"
            )
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, int | float)
            or not 0 < ttl <= MAX_PIN_TTL_S
        ):
            raise ValueError(f"a pin's ttl must be in (0, {MAX_PIN_TTL_S:g}] seconds, got {ttl!r}")


def validate_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
        raise ValueError(f"the recompute ratio must be a number in [0, 1], got {ratio!r}")
