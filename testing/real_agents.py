"""Shared by the tests that run real coding agents against a server: one agent session
through the recording proxy, with every connection outside loopback refused and recorded;
the transcript saved and the per-request cache figures printed; the protocol checks."""

from __future__ import annotations

from pathlib import Path

from radixserve.bench.agent_record import Launch, Recorded, record_session
from radixserve.bench.agent_sessions import Served
from radixserve.bench.agent_transcript import model_turns

SERVED_NAME = "qwen2.5-coder"
CONTEXT = 32768  # Qwen2.5-Coder's window
SESSION_TIMEOUT_S = 5400.0  # a CPU shared with other work prefills a 13K-token prompt slowly
# per request: enough for a tool call or a short answer; a small model that recites its
# context instead of answering stops here rather than after thousands of tokens
MAX_OUTPUT = 512


def agent_session(
    url: str, out: Path, name: str, launch: Launch, repo: Path, home: Path | None = None
) -> Recorded:
    """Run one agent session (``launch`` builds its command against the proxy's URL), read
    what crossed the wire and print its report. Sessions given one ``home`` are one user's
    (``record_session``)."""
    served = Served(url, SERVED_NAME, CONTEXT, MAX_OUTPUT)
    session = record_session(url, out, name, launch, repo, served, SESSION_TIMEOUT_S, home)
    print(f"== {name}\n{session.report()}")
    return session


def check_protocol(session: Recorded) -> None:
    """Every request parsed and answered, every answer well formed, nothing went outside."""
    problems = [f"#{t.index} {t.method} {t.path}: {p}" for t in session.turns for p in t.problems]
    assert problems == [], "\n".join(problems)
    assert model_turns(session.turns), "the agent never called the model"
    assert session.egress == [], f"the agent tried to reach the internet: {session.egress}"


def check_cache(session: Recorded, share: float = 0.9) -> None:
    """Every model request after the first has at least ``share`` of its prompt cached."""
    turns = model_turns(session.turns)
    low = [(t.index, t.prompt_tokens, t.cached_tokens) for t in turns[1:]
           if t.cached_share is None or t.cached_share < share]  # fmt: skip
    assert low == [], f"requests under {share:.0%} cached (index, prompt, cached): {low}"
