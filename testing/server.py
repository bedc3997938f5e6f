"""Start a real ``radixserve serve`` process on a free loopback port, for tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from radixserve.bench.processes import read_metrics


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)  # everything it printed so far

    @property
    def log(self) -> str:
        return "".join(self.lines)


@contextlib.contextmanager
def started_server(*args: str, timeout: float = 180.0, new_session: bool = False):
    """Yield a ``ServerProcess`` started with ``args``; stop it afterwards (if still up).
    ``new_session``: in a process group of its own (whose id is its pid), as a terminal or a
    service manager starts it, so that a test can signal the whole group."""
    cmd = [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "--port",
        "0",
        "--log-level",
        "warning",
        *args,
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=new_session,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited before listening:\n" + "".join(lines[-30:]))
            lines.append(line)
            if line.startswith("radixserve listening on "):
                url = line.split()[-1]
            if url is None and time.monotonic() > deadline:  # a late "listening" still counts
                raise RuntimeError("server did not start in time:\n" + "".join(lines[-30:]))
        # keep draining its output so the pipe never fills and blocks it
        threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
        httpx.get(url + "/health", timeout=10).raise_for_status()
        yield ServerProcess(url, proc, lines)
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_server(*args: str, timeout: float = 180.0):
    """Yield the base URL of a server started with ``args``; stop it afterwards."""
    with started_server(*args, timeout=timeout) as server:
        yield server.url


def wait_idle(url: str, headers: dict[str, str], timeout: float = 30) -> dict[str, float]:
    """Wait until the engine runs and queues nothing; return the metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url, headers)
        if m["num_running_reqs"] == 0 and m["num_queue_reqs"] == 0:
            return m
        assert time.monotonic() < deadline, f"requests still running: {m['num_running_reqs']}"
        time.sleep(0.2)


def child_pids(pid: int) -> list[int]:
    """The direct children of a process (of its main thread, which starts them all here)."""
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except FileNotFoundError:
        return []


def engine_pid(server_pid: int) -> int:
    """The engine process among a server's children (the other is multiprocessing's
    resource tracker)."""
    for pid in child_pids(server_pid):
        try:
            cmdline = open(f"/proc/{pid}/cmdline").read()
        except FileNotFoundError:
            continue
        if "spawn_main" in cmdline:
            return int(pid)
    raise LookupError(f"no engine process under {server_pid}")


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
