"""Start a real ``radixserve serve`` process on a free loopback port, for tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx


class ServerURL(str):
    """A server's base URL that also carries its process (for tests that kill it)."""

    proc: subprocess.Popen


@contextlib.contextmanager
def running_server(*args: str, timeout: float = 180.0):
    """Yield the base URL of a server started with ``args`` (a ``ServerURL``: ``.proc`` is
    the process); stop it afterwards."""
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
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines = []
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
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start in time:\n" + "".join(lines[-30:]))
        # keep draining its output so the pipe never fills and blocks it
        import threading

        threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
        httpx.get(url + "/health", timeout=10).raise_for_status()
        url = ServerURL(url)
        url.proc = proc
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
