"""Real coding agents run against a server: Claude Code (``claude -p``, the Anthropic
Messages API), Codex CLI (``codex exec``, the OpenAI Responses API) and mini-SWE-agent (a
Python agent, chat completions through litellm).

The npm agents are installed at a pinned version into ``cache_dir()/npm/<name>@<version>``
(``npm_bin``) the first time they are asked for; mini-SWE-agent comes from the ``agents``
extra. Each session gets a home of its own (its config, its session files), a scratch git
repository to work in (``scratch_repo``), and settings that keep it offline: no telemetry,
no error reports, no update checks, no feedback prompts, the served model's real context
window (so that it compacts in time), no retries (a failed request is seen, not hidden) and
timeouts long enough for a CPU. ``EgressTrap`` is an HTTP(S) proxy that refuses every
connection and records where it was going: with it as the agent's proxy (loopback excepted),
any attempt to reach the internet is seen.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from radixserve.utils import cache_dir

NPM_TIMEOUT_S = 900


class AgentUnavailable(RuntimeError):
    """An agent cannot be installed here (no npm, no registry); the message says why."""


@dataclass(frozen=True)
class NpmPackage:
    name: str
    version: str  # pinned: an agent's requests change from release to release
    bin: str

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"


CLAUDE_CODE = NpmPackage("@anthropic-ai/claude-code", "2.1.332", "claude")
CODEX = NpmPackage("@openai/codex", "0.171.0", "codex")


def npm_bin(package: NpmPackage, root: Path | None = None) -> Path:
    """The package's executable, installed first if absent (one install at a time, under a
    lock file). Raises ``AgentUnavailable`` when npm is missing or the install fails."""
    root = root or cache_dir() / "npm"
    prefix = root / package.spec.replace("/", "+")
    exe = prefix / "node_modules" / ".bin" / package.bin
    if exe.exists():
        return exe
    npm = shutil.which("npm")
    if npm is None:
        raise AgentUnavailable(f"npm is not installed, so {package.spec} cannot be")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        cmd = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
               "--no-update-notifier", "--loglevel=error", package.spec]  # fmt: skip
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise AgentUnavailable(f"npm install {package.spec} timed out") from e
        if out.returncode != 0 or not exe.exists():
            shutil.rmtree(prefix, ignore_errors=True)
            raise AgentUnavailable(
                f"npm install {package.spec} failed (is the npm registry reachable?):\n"
                + (out.stderr or out.stdout)[-2000:]
            )
    return exe


def mini_swe_agent_argv() -> list[str]:
    """The ``mini`` command of mini-SWE-agent, from this interpreter's environment."""
    import importlib.util

    if importlib.util.find_spec("minisweagent") is None:
        raise AgentUnavailable("mini-SWE-agent is not installed: pip install 'radixserve[agents]'")
    return [sys.executable, "-m", "minisweagent.run.mini"]


GREETER = '''def greet(name):
    """A greeting for name."""
    return "Hello, " + name + "!"


if __name__ == "__main__":
    print(greet("radix"))
'''
README = "# greeter\n\nA tiny program that greets.\n"
# the small tasks agents are given in the scratch repository, and the answer to the first
READ_TASK = "What does hello.py print when it is run? Answer with the exact output."
WRITE_TASK = "Create a file named NOTES.md whose only line is: greeter prints a greeting."
BOTH_TASK = ("Read hello.py, then create a file named output.txt that holds exactly what "
             "hello.py prints when it is run.")  # fmt: skip
EXPECTED = "Hello, radix!"


def scratch_repo(path: Path) -> Path:
    """A git repository with one commit: ``hello.py`` (prints ``Hello, radix!``) and a
    README."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "hello.py").write_text(GREETER)
    (path / "README.md").write_text(README)
    git = ["git", "-c", "user.name=radixserve", "-c", "user.email=radixserve@localhost"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "greeter"]):
        subprocess.run([*git, *args], cwd=path, check=True, capture_output=True)
    return path


@dataclass
class AgentRun:
    argv: list[str]
    returncode: int | None  # None: killed at its timeout
    stdout: str
    stderr: str
    seconds: float


def run_agent(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> AgentRun:
    """Run an agent to its end (or its timeout: then its whole process group is killed)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return AgentRun(argv, code, out, err, time.monotonic() - start)


class EgressTrap:
    """A proxy that answers every connection with 403 and records in ``attempts`` the first
    line of each proxy request (``CONNECT host:443 ...`` or ``GET http://...``). A request
    for a bare path (``GET /metrics``) is no agent's proxy request but another program on
    the machine knocking on a port it used to know: refused, not recorded."""

    def __init__(self):
        self.attempts: list[str] = []
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> EgressTrap:
        self._sock.listen(16)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._sock.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    line = conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    line = "(no request line)"
                if is_proxy_request(line):
                    self.attempts.append(line)

    def env(self) -> dict[str, str]:
        """Proxy variables that send everything but loopback traffic here."""
        local = "127.0.0.1,localhost,::1"
        return {"HTTP_PROXY": self.url, "HTTPS_PROXY": self.url, "http_proxy": self.url,
                "https_proxy": self.url, "NO_PROXY": local, "no_proxy": local}  # fmt: skip


def is_proxy_request(line: str) -> bool:
    """A request line a client sends to a proxy: ``CONNECT host:port`` or an absolute URL."""
    parts = line.split()
    if len(parts) < 2:
        return line == "(no request line)"
    return parts[0] == "CONNECT" or "://" in parts[1]


def base_env(home: Path, egress: EgressTrap | None) -> dict[str, str]:
    """A clean environment: PATH and a home of the session's own."""
    home.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1",
           "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@localhost",
           "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@localhost"}  # fmt: skip
    if egress is not None:
        env.update(egress.env())
    return env
