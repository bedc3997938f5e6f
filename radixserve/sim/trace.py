"""Traces: what a simulation replays, as token ids with timing.

A trace is a list of sessions. A session is a conversation: its turns arrive one after the
other, turn k+1 ``think_time`` seconds after turn k's answer ended (a closed loop per user, as
in real chat). Each turn has its prompt's token ids and the token ids it will generate (known
in advance, so the tree caches exactly what a real run would: in a chat, the next prompt
contains them). A session's first turn arrives at ``arrival`` when the trace fixes it (open
loop, e.g. Mooncake timestamps or Poisson starts); with ``arrival=None`` the load shape of the
run decides (at most N sessions in flight, as ``radixserve bench`` does).

Token arrays are int32. Turns of one session share one buffer where they can (a turn's prompt
and output are views), so a long chat costs its length once, not once per turn.

Mooncake's open trace format (JSON Lines, one request per line): ``timestamp`` (ms),
``input_length``, ``output_length``, ``hash_ids`` (one id per block of ``block_size`` = 512
prompt tokens; equal ids mean equal blocks with equal prefixes). A block's tokens are drawn
from its id, so equal ids give equal tokens; the last block is cut to the input length. The
answer's tokens are drawn at random: no later prompt contains them (the trace's hashes of a
later turn cannot say which of its blocks held the answer). ``load_mooncake()`` without a path
reads the trace shipped in ``traces/`` (the FAST'25 synthetic trace, Apache-2.0).
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

MOONCAKE_BLOCK_SIZE = 512
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
SYNTHETIC_VOCAB = 32000  # token ids drawn for synthetic text (any model's vocabulary holds them)


class TraceError(ValueError):
    """A trace file or parameter is unusable; the message says which and why."""


@dataclass
class Turn:
    prompt: np.ndarray
    output: np.ndarray
    think_time: float = 0.0  # seconds after the previous turn's end (first turn: ignored)


@dataclass
class Session:
    id: str
    turns: list[Turn]
    arrival: float | None = None
    namespace: str | None = None  # the tenant's cache namespace


@dataclass
class Trace:
    name: str
    sessions: list[Session]
    params: dict[str, Any] = field(default_factory=dict)
    turn_end_ids: tuple[int, ...] = ()  # tokens that close a chat message in its prompts

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def timed(self) -> bool:
        """True when every session's start is fixed by the trace (an open loop)."""
        return all(s.arrival is not None for s in self.sessions)

    def requests(self) -> list[tuple[Session, int, Turn]]:
        return [(s, k, t) for s in self.sessions for k, t in enumerate(s.turns)]

    def max_sequence(self) -> int:
        return max((len(t.prompt) + len(t.output) for _, _, t in self.requests()), default=0)

    def head(self, num_requests: int) -> Trace:
        """The first sessions holding at most ``num_requests`` requests (at least one)."""
        kept, n = [], 0
        for s in self.sessions:
            if kept and n + len(s.turns) > num_requests:
                break
            kept.append(s)
            n += len(s.turns)
        return Trace(self.name, kept, {**self.params, "num_requests": n})


def block_tokens(hash_id: int, block_size: int, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng([int(hash_id) & (2**63 - 1), salt])
    return rng.integers(3, SYNTHETIC_VOCAB, block_size, dtype=np.int32)


def shipped_trace(name: str) -> Path:
    """The path of a trace shipped with the simulator (``traces/``)."""
    return Path(str(resources.files("radixserve.sim") / "traces" / name))


MOONCAKE_SHIPPED = "mooncake_synthetic_trace.jsonl.gz"


def load_mooncake(
    path: str | Path | None = None, block_size: int = MOONCAKE_BLOCK_SIZE, seed: int = 0
) -> Trace:
    """Read a Mooncake JSONL trace (gzipped if its name ends in ``.gz``; None: the shipped
    one); a request is a one-turn session at its timestamp."""
    path = shipped_trace(MOONCAKE_SHIPPED) if path is None else Path(path).expanduser()
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise TraceError(f"block_size must be a positive integer, got {block_size!r}")
    sessions: list[Session] = []
    blocks: dict[int, np.ndarray] = {}
    rng = np.random.default_rng(seed)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            arrival, n_in, n_out, ids = _mooncake_record(line, f"{path}: line {number}", block_size)
            parts = []
            for h in ids:
                if h not in blocks:
                    blocks[h] = block_tokens(h, block_size, seed)
                parts.append(blocks[h])
            prompt = np.concatenate(parts)[:n_in]
            output = rng.integers(3, SYNTHETIC_VOCAB, n_out, dtype=np.int32)
            sessions.append(Session(f"r{number}", [Turn(prompt, output)], arrival))
    if not sessions:
        raise TraceError(f"{path}: no requests")
    t0 = min(s.arrival for s in sessions)
    for s in sessions:
        s.arrival -= t0
    sessions.sort(key=lambda s: s.arrival)
    return Trace("mooncake", sessions, {"path": str(path), "block_size": block_size})


def _mooncake_record(line: str, where: str, block_size: int) -> tuple[float, int, int, list]:
    """One line's (arrival in seconds, input length, output length, hash ids), or a
    ``TraceError`` naming the line and what is wrong with it."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where} is not JSON ({e})") from e
    if not isinstance(rec, dict):
        raise TraceError(f"{where} is not a JSON object")
    missing = [k for k in MOONCAKE_FIELDS if k not in rec]
    if missing:
        raise TraceError(f"{where} lacks {missing}")
    t, n_in, n_out, ids = (rec[k] for k in MOONCAKE_FIELDS)
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: timestamp must be a number of milliseconds >= 0, got {t!r}")
    for name, n in (("input_length", n_in), ("output_length", n_out)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TraceError(f"{where}: {name} must be a positive integer, got {n!r}")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    if len(ids) != -(-n_in // block_size):
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for {n_in} tokens in blocks of {block_size} "
            f"(expected {-(-n_in // block_size)})"
        )
    return float(t) / 1000.0, n_in, n_out, ids
