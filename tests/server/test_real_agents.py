"""Real coding agents pointed at radixserve on Qwen2.5-Coder (slow; each starts everything
itself): Claude Code (``claude -p``, Anthropic Messages), Codex CLI (``codex exec``, OpenAI
Responses) and mini-SWE-agent (chat completions), each doing a small task in a scratch git
repository. The npm agents are installed at their pinned versions into the cache directory
on first use (skipped, saying why, when npm or its registry is not there); mini-SWE-agent
comes from the ``agents`` extra.

What is asserted is the server's part: every request the agent sent was parsed and
answered (no 4xx or 5xx), every answer well formed (each stream in its API's order), no
connection went outside loopback (the agents are set up to stay offline), and the cache at
work: every model request after a session's first has >= 90% of its prompt cached, and a
second, new Claude Code session in the same repository and home (Claude Code writes its
home's path into its system prompt, before the tools) finds its system prompt and tools
cached on its first request, and says so already in the ``message_start`` sent when the
request is admitted. Each request's output is capped (``testing/real_agents.py``):
a small model that recites its prompt instead of answering would otherwise decode for
hours on a CPU. Whether the small model does the task is printed with the
per-request figures and the transcript's path, not asserted.

``RADIXSERVE_AGENT_MODEL`` picks the model (default ``qwen2.5-coder-0.5b``; ``-1.5b`` too).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

from radixserve.bench.agent_sessions import claude_session, codex_session, mini_session
from radixserve.bench.agent_transcript import model_turns
from radixserve.bench.agent_wire import sse_events
from radixserve.bench.agents import (
    BOTH_TASK,
    CLAUDE_CODE,
    CODEX,
    EXPECTED,
    READ_TASK,
    WRITE_TASK,
    AgentUnavailable,
    mini_swe_agent_argv,
    npm_bin,
    scratch_repo,
)
from radixserve.model.registry import KNOWN_MODELS, installed_path
from testing.real_agents import (
    CONTEXT,
    MAX_OUTPUT,
    SERVED_NAME,
    agent_session,
    check_cache,
    check_protocol,
)
from testing.server import running_server

MODEL = KNOWN_MODELS[os.environ.get("RADIXSERVE_AGENT_MODEL", "qwen2.5-coder-0.5b")]


@pytest.fixture(scope="module")
def agent_server():
    path = installed_path(MODEL)
    if path is None:
        pytest.skip(f"{MODEL.name} is not installed (`radixserve pull {MODEL.name}`)")
    # Codex sends no output limit: the server's default caps it as the others cap theirs
    args = ("--model", str(path), "--served-model-name", SERVED_NAME, "--max-model-len",
            str(CONTEXT), "--max-total-tokens", str(2 * CONTEXT),
            "--default-sampling", f"max_tokens={MAX_OUTPUT}")  # fmt: skip
    with running_server(*args, timeout=900) as url:
        yield url


def installed(package):
    try:
        return npm_bin(package)
    except AgentUnavailable as e:
        pytest.skip(str(e))


def outcome(repo, answer_file: str | None = None, text: str = "") -> str:
    """What the agent achieved, for the printout (a small model may fail the task)."""
    if answer_file is None:
        return f"answer names the output: {EXPECTED in text}"
    path = repo / answer_file
    return f"{answer_file}: " + (repr(path.read_text()[:200]) if path.exists() else "absent")


def system_and_tools_tokens(url: str, request: bytes) -> int:
    """Tokens of a Messages request's system prompt and tools, as the server renders them:
    counted with one one-character user turn (a few tokens) in place of the conversation."""
    body = json.loads(request)
    probe = {k: body[k] for k in ("model", "system", "tools") if k in body}
    probe["messages"] = [{"role": "user", "content": "."}]
    r = httpx.post(url + "/v1/messages/count_tokens", json=probe, timeout=120)
    r.raise_for_status()
    return r.json()["input_tokens"] - 8  # the user turn "." and the assistant's header


@pytest.mark.slow
def test_claude_code_sessions_are_served_and_cached(agent_server, tmp_path):
    exe = installed(CLAUDE_CODE)
    repo = scratch_repo(tmp_path / "repo")

    def launch(task):
        return lambda served, home, trap: claude_session(exe, served, repo, task, home,
                                                         egress=trap)  # fmt: skip

    home = tmp_path / "claude-home"  # one user's two sessions: one home, one config
    first = agent_session(agent_server, tmp_path, "claude-read", launch(READ_TASK), repo, home)
    check_protocol(first)
    check_cache(first)
    print(outcome(repo, text=first.run.stdout))
    second = agent_session(agent_server, tmp_path, "claude-write", launch(WRITE_TASK), repo,
                           home)  # fmt: skip
    check_protocol(second)
    check_cache(second)
    print(outcome(repo, "NOTES.md"))
    opening = model_turns(second.turns)[0]
    prefix = system_and_tools_tokens(agent_server, second.exchanges[opening.index].request_body)
    # message_start goes out when the request is admitted: it says what the cache gave
    start = sse_events(second.exchanges[opening.index].chunks)[0].data["message"]["usage"]
    print(
        f"second session, first request: {opening.cached_tokens} of "
        f"{opening.prompt_tokens} cached ({start['cache_read_input_tokens']} in its "
        f"message_start); system prompt and tools: {prefix} tokens"
    )
    assert opening.cached_tokens >= prefix > 5000
    assert start["cache_read_input_tokens"] == opening.cached_tokens


@pytest.mark.slow
def test_codex_exec_session_is_served_and_cached(agent_server, tmp_path):
    exe = installed(CODEX)
    repo = scratch_repo(tmp_path / "repo")
    session = agent_session(
        agent_server, tmp_path, "codex",
        lambda served, home, trap: codex_session(exe, served, repo, BOTH_TASK, home,
                                                 egress=trap), repo,
    )  # fmt: skip
    check_protocol(session)
    assert {t.api for t in model_turns(session.turns)} == {"responses"}
    check_cache(session)
    print(outcome(repo, "output.txt"))


@pytest.mark.slow
def test_mini_swe_agent_session_is_served_and_cached(agent_server, tmp_path):
    try:
        mini_swe_agent_argv()
    except AgentUnavailable as e:
        pytest.skip(str(e))
    repo = scratch_repo(tmp_path / "repo")
    session = agent_session(
        agent_server, tmp_path, "mini",
        lambda served, home, trap: mini_session(served, repo, BOTH_TASK, home, egress=trap),
        repo,
    )  # fmt: skip
    check_protocol(session)
    assert {t.api for t in model_turns(session.turns)} == {"chat"}
    check_cache(session)
    print(outcome(repo, "output.txt"))
