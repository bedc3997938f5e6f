"""Trace builders: ShareGPT chats, the bench's workloads, and synthetic sessions.

- ``sharegpt``: real ShareGPT conversations (the bench's data file): every user turn and every
  answer from the data, tokenized with the model's chat template, so turn k+1's prompt holds
  turn k's prompt and answer exactly as a server would build it. Users come back after a think
  time drawn from a distribution.
- ``bench:<workload>``: ``radixserve bench``'s workloads (``shared-prefix``, ``few-shot``,
  ``sharegpt-multiturn``, ``random``) with the same parameters and seed, tokenized the way the
  server tokenizes them (chat template or plain completion prompt); answers, which the bench
  takes from the model, are ``output_len`` tokens here.
- ``synthetic``: Zipf-popular system prompts, geometric session lengths, Poisson session
  starts; token ids drawn at random, so no tokenizer is needed.

Chat prompts are assembled from pieces: the template is rendered once with placeholder
contents, and the text between placeholders and each message are encoded separately. For
ChatML-style templates (special tokens around every message) this gives the same ids as
encoding the whole rendered text, at a cost linear in the conversation instead of quadratic.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.bench import data
from radixserve.bench.workloads import build_workload
from radixserve.sim.trace import SYNTHETIC_VOCAB, Session, Trace, TraceError, Turn

THINK_TIME_KINDS = ("exponential", "lognormal", "fixed")


@dataclass
class ThinkTime:
    """Seconds a user takes before the next turn."""

    mean: float = 0.0
    kind: str = "exponential"

    def __post_init__(self) -> None:
        if self.kind not in THINK_TIME_KINDS:
            raise TraceError(f"think time kind must be one of {THINK_TIME_KINDS}")
        if not self.mean >= 0:
            raise TraceError(f"think time mean must be >= 0, got {self.mean}")

    def draw(self, rng: np.random.Generator, n: int) -> list[float]:
        if self.mean == 0 or self.kind == "fixed":
            return [self.mean] * n
        if self.kind == "exponential":
            return rng.exponential(self.mean, n).tolist()
        sigma = 1.0  # lognormal with this shape and the requested mean
        return rng.lognormal(np.log(self.mean) - sigma**2 / 2, sigma, n).tolist()


class ChatEncoder:
    """Token ids of whole conversations through a tokenizer's chat template."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._pieces: dict[tuple[str, ...], list[np.ndarray]] = {}

    def _template(self, roles: tuple[str, ...]) -> list[np.ndarray]:
        if roles not in self._pieces:
            messages = [{"role": r, "content": f"\x00{i}\x00"} for i, r in enumerate(roles)]
            text = self.tok.render_chat(messages, add_generation_prompt=roles[-1] != "assistant")
            parts = re.split(r"\x00\d+\x00", text)
            if len(parts) != len(roles) + 1:
                raise TraceError("the chat template does not show every message once")
            self._pieces[roles] = [self._ids(p) for p in parts]
        return self._pieces[roles]

    def _ids(self, text: str | np.ndarray) -> np.ndarray:
        if isinstance(text, np.ndarray):
            return text
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=np.int32)

    def encode_all(self, texts: list[str]) -> list[np.ndarray]:
        """Many texts in one batch call (the fast tokenizer encodes a batch in parallel)."""
        if not texts:
            return []
        ids = self.tok.hf(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def conversation(
        self, system: str | np.ndarray | None, turns: list[tuple[str | np.ndarray, ...]]
    ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """``turns``: (user, answer), each text or token ids. Returns the buffer and, per turn,
        the prompt end and the answer's span."""
        roles = (("system",) if system is not None else ()) + ("user", "assistant") * len(turns)
        pieces = self._template(roles)
        contents = [self._ids(system)] if system is not None else []
        for user, answer in turns:
            contents += [self._ids(user), self._ids(answer)]
        chunks, spans, pos = [], [], 0
        for i, content in enumerate(contents):
            chunks += [pieces[i], content]
            start = pos + len(pieces[i])
            if roles[i] == "assistant":  # the prompt ends with the generation prompt piece
                spans.append((start, start, start + len(content)))
            pos = start + len(content)
        chunks.append(pieces[-1])
        return np.concatenate(chunks), spans


def _sessions_from_chats(chats, encoder, think, rng) -> list[Session]:
    texts = [
        x for _, system, turns in chats for x in (system, *sum(turns, ())) if isinstance(x, str)
    ]
    encoded = dict(zip(texts, encoder.encode_all(texts), strict=True))
    ids = lambda x: encoded[x] if isinstance(x, str) else x  # noqa: E731
    sessions = []
    for sid, system, turns in chats:
        system = None if system is None else ids(system)
        turns = [(ids(u), ids(a)) for u, a in turns]
        tokens, spans = encoder.conversation(system, turns)
        thinks = [0.0, *think.draw(rng, len(turns) - 1)]
        sessions.append(
            Session(
                sid,
                [
                    Turn(tokens[:p], tokens[a:b], t)
                    for (p, a, b), t in zip(spans, thinks, strict=True)
                ],
            )
        )
    return sessions


def iter_sharegpt_chats(path: str | None):
    """``(id, [(user, answer), ...])`` of every clean ShareGPT conversation, in file order."""
    for n, record in enumerate(data.iter_records(data.sharegpt_path(path))):
        if data.clean_user_turns(record) is None:
            continue
        messages = [m["value"] for m in record["conversations"]]
        pairs = list(zip(messages[0::2], messages[1::2], strict=False))
        if len(pairs) >= 1:
            yield str(record.get("id", n)), pairs


def sharegpt_trace(
    tokenizer: Any,
    num_sessions: int,
    max_turns: int = 8,
    max_message_tokens: int = 1024,
    think: ThinkTime | None = None,
    dataset_path: str | None = None,
    seed: int = 0,
) -> Trace:
    """Real ShareGPT chats; messages cut to ``max_message_tokens`` tokens (in characters,
    four per token, before tokenizing); think times 30 s on average unless ``think``."""
    think = think or ThinkTime(30.0)
    encoder, rng, chats = ChatEncoder(tokenizer), np.random.default_rng(seed), []
    cut = 4 * max_message_tokens
    for sid, pairs in iter_sharegpt_chats(dataset_path):
        turns = [(u[:cut], a[:cut]) for u, a in pairs[:max_turns]]
        chats.append((sid, None, turns))
        if len(chats) == num_sessions:
            break
    if len(chats) < num_sessions:
        raise TraceError(f"the dataset has only {len(chats)} clean conversations")
    params = dict(
        num_sessions=num_sessions, max_turns=max_turns,
        max_message_tokens=max_message_tokens, think_time=dataclasses.asdict(think),
    )  # fmt: skip
    sessions = _sessions_from_chats(chats, encoder, think, rng)
    return Trace("sharegpt", sessions, params, tuple(tokenizer.eos_token_ids))


def bench_trace(
    tokenizer: Any, name: str, seed: int = 0, think: ThinkTime | None = None, **params: Any
) -> Trace:
    """A ``radixserve bench`` workload as the server would see it; answers are random ids of
    the workload's ``output_len`` (the model's own answers are not known in advance)."""
    workload = build_workload(name, seed, **params)
    rng, think = np.random.default_rng(seed), think or ThinkTime(0.0)
    n_out = workload.max_tokens
    if workload.api == "completions":
        sessions = []
        for c in workload.conversations:
            prompt = np.asarray(tokenizer.encode(c.user_turns[0]), dtype=np.int32)
            sessions.append(Session(c.id, [Turn(prompt, _random_ids(rng, n_out))]))
    else:
        encoder = ChatEncoder(tokenizer)
        chats = [
            (c.id, c.system, [(u, _random_ids(rng, n_out)) for u in c.user_turns])
            for c in workload.conversations
        ]
        sessions = _sessions_from_chats(chats, encoder, think, rng)
    return Trace(f"bench:{name}", sessions, workload.params)


def _random_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(3, SYNTHETIC_VOCAB, n, dtype=np.int32)


@dataclass
class SyntheticSpec:
    """Sessions behind Zipf-popular system prompts, arriving as a Poisson process."""

    num_sessions: int = 1000
    num_system_prompts: int = 50
    system_prompt_len: int = 1000
    zipf_exponent: float = 1.1  # popularity of system prompt i ~ 1 / i**s
    mean_turns: float = 3.0  # geometric session length
    mean_user_len: int = 120
    mean_output_len: int = 150
    session_rate: float | None = 4.0  # session starts per second; None: the run's load shape
    think_time: ThinkTime = dataclasses.field(default_factory=lambda: ThinkTime(20.0))
    # a token closing every message (system prompt, user message, answer), as a chat
    # template's end-of-turn token does; None: messages run on without one
    turn_end_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_system_prompts", "system_prompt_len",
                     "mean_user_len", "mean_output_len"):  # fmt: skip
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise TraceError(f"{name} must be a positive integer")
        if self.mean_turns < 1 or self.zipf_exponent < 0:
            raise TraceError("mean_turns must be >= 1 and zipf_exponent >= 0")
        if self.session_rate is not None and not self.session_rate > 0:
            raise TraceError("session_rate must be > 0")


def synthetic_trace(spec: SyntheticSpec, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    systems = [_random_ids(rng, spec.system_prompt_len) for _ in range(spec.num_system_prompts)]
    for ids in systems:
        _end_message(ids, len(ids), spec.turn_end_id)
    weights = 1.0 / np.arange(1, spec.num_system_prompts + 1) ** spec.zipf_exponent
    picks = rng.choice(spec.num_system_prompts, spec.num_sessions, p=weights / weights.sum())
    turns_per = rng.geometric(1.0 / spec.mean_turns, spec.num_sessions)
    t, sessions = 0.0, []
    for i in range(spec.num_sessions):
        n = int(turns_per[i])
        users = np.maximum(1, rng.exponential(spec.mean_user_len, n).astype(int))
        outs = np.maximum(1, rng.exponential(spec.mean_output_len, n).astype(int))
        exchanges = [_random_ids(rng, int(u + o)) for u, o in zip(users, outs, strict=True)]
        for ids, u in zip(exchanges, users, strict=True):
            _end_message(ids, int(u), spec.turn_end_id)  # the user's message
            _end_message(ids, len(ids), spec.turn_end_id)  # the answer
        buf = np.concatenate([systems[picks[i]], *exchanges])
        thinks = [0.0, *spec.think_time.draw(rng, n - 1)]
        pos, turns = spec.system_prompt_len, []
        for u, o, think in zip(users, outs, thinks, strict=True):
            turns.append(Turn(buf[: pos + u], buf[pos + u : pos + u + o], think))
            pos += int(u + o)
        arrival = None
        if spec.session_rate is not None:
            arrival = t
            t += rng.exponential(1.0 / spec.session_rate)
        sessions.append(Session(f"s{i}", turns, arrival))
    params = {**dataclasses.asdict(spec), "seed": seed}
    ends = () if spec.turn_end_id is None else (spec.turn_end_id,)
    return Trace("synthetic", sessions, params, ends)


def _end_message(ids: np.ndarray, end: int, turn_end_id: int | None) -> None:
    """Close the message ending at ``end`` with ``turn_end_id`` (None: leave it as it is)."""
    if turn_end_id is not None:
        ids[end - 1] = turn_end_id
