"""Prompts with RAG segments, from the HTTP API to token ids and reusable ranges.

- ``/generate`` takes ``segments``: text or token-id pieces, each ``reusable`` or not;
- chat completions take ``"reusable": true`` on a text content part of a message.

Every reusable piece is tokenized alone (so a passage has the same tokens wherever it sits,
and its stored KV matches); the engine gets the prompt and the ``(start, end)`` token range of
each reusable piece (``Engine.add_request(segments=...)``). A chat prompt is rendered by the
chat template with a unique marker in place of each reusable part, then cut at the markers;
the pieces between are tokenized as ``encode_chat`` would (no special tokens added).
"""

from __future__ import annotations

import uuid
from typing import Any

from radixserve.api.errors import ApiError
from radixserve.api.protocol import PLACEHOLDER
from radixserve.model.tokenizer import Tokenizer

Ranges = list[tuple[int, int]]


def join_pieces(pieces: list[tuple[list[int], bool]]) -> tuple[list[int], Ranges]:
    ids: list[int] = []
    ranges = []
    for piece, reusable in pieces:
        if reusable and piece:
            ranges.append((len(ids), len(ids) + len(piece)))
        ids += piece
    return ids, ranges


def encode_segments(tokenizer: Tokenizer, segments: list) -> tuple[list[int], Ranges]:
    """``/generate``'s ``segments`` (``PromptSegment``s) as one prompt and its ranges."""
    pieces = []
    for seg in segments:
        ids = seg.input_ids if seg.input_ids is not None else tokenizer.encode(seg.text, False)
        pieces.append((ids, seg.reusable))
    return join_pieces(pieces)


def encode_chat_segments(
    tokenizer: Tokenizer, conversation: list[dict[str, Any]], reusable: list[str]
) -> tuple[list[int], Ranges]:
    """``conversation``: messages whose content holds ``marker(i)`` where the ``i``-th
    reusable part was; ``reusable``: those parts' texts, in order."""
    tag = uuid.uuid4().hex
    marked = [
        {**m, "content": m["content"].replace(PLACEHOLDER, f"\x00{tag}\x00")} for m in conversation
    ]
    rendered = tokenizer.render_chat(marked)
    cuts = rendered.split(f"\x00{tag}\x00")
    if len(cuts) != len(reusable) + 1:
        raise ApiError(400, "the chat template dropped or repeated a reusable content part "
                       "(or a message holds NUL characters)", "messages")  # fmt: skip
    pieces = [(tokenizer.encode(cuts[0], False), False)]
    for text, after in zip(reusable, cuts[1:], strict=True):
        pieces += [(tokenizer.encode(text, False), True), (tokenizer.encode(after, False), False)]
    return join_pieces(pieces)
