"""One agent session, recorded: the agent is pointed at a ``RecordingProxy`` in front of the
server, every connection it makes outside loopback goes to an ``EgressTrap`` (refused and
noted), and what crossed the wire is read back as ``Turn``s and saved as a transcript.

``record_session`` is shared by the slow tests that run real agents and by the benchmark
that times them against llama.cpp's server; ``Recorded.report`` is the text both print: how
the agent ended, then one JSON line per model request (prompt tokens, cached tokens and their
share, TTFT, end to end, stop reason, tools called).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.bench.agent_proxy import Exchange, RecordingProxy
from radixserve.bench.agent_sessions import Served
from radixserve.bench.agent_transcript import cache_rows, model_turns, read_turns, save_transcript
from radixserve.bench.agent_wire import Turn
from radixserve.bench.agents import AgentRun, EgressTrap, run_agent

# builds an agent's (argv, env) against the proxy, with a home of its own and the trap
Launch = Callable[[Served, Path, EgressTrap], tuple[list[str], dict[str, str]]]


@dataclass
class Recorded:
    name: str
    run: AgentRun
    exchanges: list[Exchange]
    turns: list[Turn]
    egress: list[str]  # where the agent tried to connect outside loopback
    transcript: Path

    def report(self) -> str:
        """How the agent ended, then one JSON line per model request, then its output."""
        head = f"agent exit {self.run.returncode} after {self.run.seconds:.0f} s; transcript: "
        rows = [json.dumps(row) for row in cache_rows(self.turns)]
        return "\n".join([head + str(self.transcript), *rows, "agent stdout (tail):",
                          self.run.stdout[-3000:], "agent stderr (tail):",
                          self.run.stderr[-2000:]])  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The session in figures: its time, its model requests and their tokens."""
        turns = model_turns(self.turns)
        first = turns[0] if turns else None
        return {
            "seconds": round(self.run.seconds, 2),
            "exit": self.run.returncode,
            "model_requests": len(turns),
            "failed_requests": sum(1 for t in self.turns if t.problems),
            "prompt_tokens": sum(t.prompt_tokens or 0 for t in turns),
            "cached_tokens": sum(t.cached_tokens or 0 for t in turns),
            "output_tokens": sum(t.output_tokens or 0 for t in turns),
            "first_request": None if first is None else
            {"prompt": first.prompt_tokens, "cached": first.cached_tokens},
        }  # fmt: skip


def record_session(
    url: str, out: Path, name: str, launch: Launch, repo: Path, served: Served,
    timeout: float, home: Path | None = None,
) -> Recorded:  # fmt: skip
    """Run one agent session against the server at ``url`` (through the proxy; ``served``
    names the model and its window, its ``url`` is replaced by the proxy's) and read what
    crossed the wire. Files: ``home`` (the agent's home, default ``out/NAME-home``; sessions
    given the same home are one user's sessions: Claude Code writes the home's path into
    its system prompt, so only those share their system prompt's cache),
    ``NAME-transcript.jsonl``, ``NAME-stdout.txt`` and ``NAME-journal.txt`` (written as
    the session runs)."""
    journal = out / f"{name}-journal.txt"
    with RecordingProxy(url, journal=journal) as proxy, EgressTrap() as trap:
        pointed = Served(proxy.url, served.model, served.context, served.max_output)
        argv, env = launch(pointed, home or out / f"{name}-home", trap)
        run = run_agent(argv, env, repo, timeout)
    transcript = save_transcript(proxy.exchanges, out / f"{name}-transcript.jsonl")
    (out / f"{name}-stdout.txt").write_text(run.stdout)
    turns = read_turns(proxy.exchanges)
    return Recorded(name, run, proxy.exchanges, turns, trap.attempts, transcript)
