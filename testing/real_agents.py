"""Shared by the tests that run real coding agents against a server: one agent session
through the recording proxy, with every connection outside loopback refused and recorded;
the transcript saved and the per-request cache figures printed; the protocol checks."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from radixserve.bench.agent_proxy import Exchange, RecordingProxy
from radixserve.bench.agent_sessions import Served
from radixserve.bench.agent_transcript import cache_rows, model_turns, read_turns, save_transcript
from radixserve.bench.agent_wire import Turn
from radixserve.bench.agents import AgentRun, EgressTrap, run_agent

SERVED_NAME = "qwen2.5-coder"
CONTEXT = 32768  # Qwen2.5-Coder's window
SESSION_TIMEOUT_S = 5400.0  # a CPU shared with other work prefills a 13K-token prompt slowly


@dataclass
class Session:
    run: AgentRun
    exchanges: list[Exchange]
    turns: list[Turn]
    egress: list[str]  # where the agent tried to connect outside loopback
    transcript: Path

    def report(self) -> str:
        """What the test prints: how the agent ended, then one JSON line per model turn."""
        head = f"agent exit {self.run.returncode} after {self.run.seconds:.0f} s; transcript: "
        rows = [json.dumps(row) for row in cache_rows(self.turns)]
        return "\n".join([head + str(self.transcript), *rows, "agent stdout (tail):",
                          self.run.stdout[-3000:], "agent stderr (tail):",
                          self.run.stderr[-2000:]])  # fmt: skip


Launch = Callable[[Served, Path, EgressTrap], tuple[list[str], dict[str, str]]]


def agent_session(url: str, out: Path, name: str, launch: Launch, repo: Path) -> Session:
    """Run one agent session (``launch`` builds its command against the proxy's URL) and
    read what crossed the wire."""
    with RecordingProxy(url) as proxy, EgressTrap() as trap:
        served = Served(proxy.url, SERVED_NAME, CONTEXT)
        argv, env = launch(served, out / f"{name}-home", trap)
        run = run_agent(argv, env, repo, SESSION_TIMEOUT_S)
    transcript = save_transcript(proxy.exchanges, out / f"{name}-transcript.jsonl")
    (out / f"{name}-stdout.txt").write_text(run.stdout)
    session = Session(run, proxy.exchanges, read_turns(proxy.exchanges), trap.attempts,
                      transcript)  # fmt: skip
    print(f"== {name}\n{session.report()}")
    return session


def check_protocol(session: Session) -> None:
    """Every request parsed and answered, every answer well formed, nothing went outside."""
    problems = [f"#{t.index} {t.method} {t.path}: {p}" for t in session.turns for p in t.problems]
    assert problems == [], "\n".join(problems)
    assert model_turns(session.turns), "the agent never called the model"
    assert session.egress == [], f"the agent tried to reach the internet: {session.egress}"


def check_cache(session: Session, share: float = 0.9) -> None:
    """Every model request after the first has at least ``share`` of its prompt cached."""
    turns = model_turns(session.turns)
    low = [(t.index, t.prompt_tokens, t.cached_tokens) for t in turns[1:]
           if t.cached_share is None or t.cached_share < share]  # fmt: skip
    assert low == [], f"requests under {share:.0%} cached (index, prompt, cached): {low}"
