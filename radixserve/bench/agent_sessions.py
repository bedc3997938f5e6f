"""The command line and environment of one session of each agent, pointed at a server.

``Served`` says where the model is and what it is (its served name and context window).
Each ``*_session`` function returns ``(argv, env)`` for ``agents.run_agent``; the session's
files (config, session logs) live under the ``home`` it is given.

Claude Code: ``claude -p PROMPT`` with ``ANTHROPIC_BASE_URL``; the served model for both its
main and its small model; ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` the served window (it applies
to model names that do not start with ``claude-``, and sets when it compacts);
``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` (no telemetry, error reports or update checks);
``CLAUDE_CODE_ATTRIBUTION_HEADER=0``; its stream watchdogs at their longest (the server
keeps a stream alive with ``ping`` events while it reads a long prompt, but Claude Code
also drops a stream whose answer has not begun after some minutes); ``--permission-mode
acceptEdits`` (it may write files in the repository, and as root it refuses to skip
permissions altogether); its events as ``stream-json`` on stdout.

Codex CLI: ``codex exec`` with ``CODEX_HOME`` holding a config whose provider speaks the
Responses wire (``wire_api = "responses"``) to the server, the served window as
``model_context_window``, no update check, analytics, feedback or history, no retries, a
long stream idle timeout; the ``workspace-write`` sandbox; its events as JSON lines.

mini-SWE-agent: ``mini`` with one of its stock configs (one ``bash`` tool through chat
completions): ``swebench.yaml`` by default, the instructions it is benchmarked with (about
1,100 tokens with its tool: workflow, command rules, how to submit), run locally instead of
in its Docker image, or ``mini.yaml``, its short interactive one; litellm's ``openai/``
provider pointed at the server, cost tracking off (the served model has no price), litellm's
model price map read from the package rather than fetched, a step limit, and the repository
as its working directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from radixserve.bench.agents import EgressTrap, base_env, mini_swe_agent_argv

API_KEY = "radixserve-agent"  # any value: the server is started without keys
LONG_TIMEOUT_MS = 3_600_000  # an hour per request: a CPU prefills a 15K-token prompt slowly
STREAM_WATCHDOG_MS = 1_800_000  # the longest Claude Code's stream watchdogs accept


@dataclass(frozen=True)
class Served:
    url: str  # the server (or a proxy in front of it), without /v1
    model: str  # the served model name
    context: int  # the model's context window, as served (--max-model-len)
    max_output: int = 2048  # the agent's output limit per request


def claude_session(
    exe: Path, served: Served, repo: Path, prompt: str, home: Path, *, max_turns: int = 6,
    egress: EgressTrap | None = None,
) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    env = base_env(home, egress)
    env.update({
        "ANTHROPIC_BASE_URL": served.url,
        "ANTHROPIC_API_KEY": API_KEY,
        "ANTHROPIC_MODEL": served.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model,
        "ANTHROPIC_SMALL_FAST_MODEL": served.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": served.model,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(served.context),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(served.max_output),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "API_TIMEOUT_MS": str(LONG_TIMEOUT_MS),
        # its stream watchdogs (first byte, idle bytes, idle events) at their longest, and
        # the cap on them lifted: a CPU may prefill the first 12K-token prompt for minutes
        "CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS": str(STREAM_WATCHDOG_MS),
        "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": str(STREAM_WATCHDOG_MS),
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(STREAM_WATCHDOG_MS),
        "API_FORCE_IDLE_TIMEOUT": "0",
    })  # fmt: skip
    argv = [str(exe), "-p", prompt, "--max-turns", str(max_turns), "--output-format",
            "stream-json", "--verbose", "--permission-mode", "acceptEdits"]  # fmt: skip
    return argv, env


def codex_config(served: Served) -> str:
    """``config.toml`` for ``codex exec`` against the server."""
    return f"""model = "{served.model}"
model_provider = "radixserve"
model_context_window = {served.context}
approval_policy = "never"
sandbox_mode = "workspace-write"
check_for_update_on_startup = false

[model_providers.radixserve]
name = "radixserve"
base_url = "{served.url}/v1"
wire_api = "responses"
env_key = "RADIXSERVE_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {LONG_TIMEOUT_MS}
supports_websockets = false

[analytics]
enabled = false

[feedback]
enabled = false

[history]
persistence = "none"

[features]
plugins = false
"""


def codex_session(
    exe: Path, served: Served, repo: Path, prompt: str, home: Path, *,
    egress: EgressTrap | None = None,
) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    env = base_env(home, egress)
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(served))
    env.update({"CODEX_HOME": str(codex_home), "RADIXSERVE_API_KEY": API_KEY})
    argv = [str(exe), "exec", "--json", "--color", "never", "-C", str(repo), prompt]
    return argv, env


MINI_CONFIGS = {
    "swebench.yaml": {"environment.environment_class": "local",
                      "environment.env.BASH_ENV": ""},  # its image's shell setup
    "mini.yaml": {},
}  # fmt: skip


def mini_session(
    served: Served, repo: Path, prompt: str, home: Path, *, step_limit: int = 6,
    egress: EgressTrap | None = None, config: str = "swebench.yaml",
) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    env = base_env(home, egress)
    env.update({
        "MSWEA_CONFIGURED": "true",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mini-swe-agent"),
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    })  # fmt: skip
    settings = {
        "model.model_kwargs.api_base": f"{served.url}/v1",
        "model.model_kwargs.api_key": API_KEY,
        "model.model_kwargs.temperature": "0",
        "model.model_kwargs.max_tokens": str(served.max_output),
        "model.cost_tracking": "ignore_errors",
        "agent.step_limit": str(step_limit),
        "environment.cwd": str(repo),
        **MINI_CONFIGS[config],
    }
    argv = [*mini_swe_agent_argv(), "-m", f"openai/{served.model}", "-t", prompt, "-y",
            "--exit-immediately", "-o", str(home / "trajectory.json"),
            "-c", config]  # fmt: skip
    for key, value in settings.items():
        argv += ["-c", f"{key}={value}"]
    return argv, env
