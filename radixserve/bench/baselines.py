"""The systems a benchmark compares, each started and stopped by the harness.

| system | what runs |
|---|---|
| ``radix`` | ``radixserve serve`` with the radix cache and ``--schedule-policy lpm`` |
| ``no-cache`` | ``radixserve serve --disable-prefix-caching`` |
| ``fcfs`` | ``radixserve serve --schedule-policy fcfs`` (cache on) |
| ``dfs-weight`` | ``radixserve serve --schedule-policy dfs-weight`` (cache on) |
| ``radix-nodrafts`` | ``radix`` with ``--draft-sources none`` (``radix`` drafts as by default) |
| ``radix-alldrafts`` | ``radix`` with every draft source (``--draft-sources grammar,text,cache``) |
| ``llamacpp`` | llama.cpp's server (PyPI ``xllamacpp``) on the same GGUF file, prompt cache on |
| ``fleet-POLICY`` | ``radixserve serve --dp N --router-policy POLICY``: N instances, the router |
| ``single-big`` | one instance whose KV pool is the fleet's total (N x per-instance pool) |

Fleet systems take ``instances`` (N) and ``instance_kv_tokens`` (each instance's pool, so that
routing is what decides); ``single-big`` is the optimum a fleet of N can hope for. With
``instance_host_kv_memory`` every instance also gets a host tier of that size
(``--host-kv-memory``), and ``single-big`` N times it, so the comparison stays even.

Every server is a child process in its own session on a free loopback port (found by binding
127.0.0.1:0), with its output in ``<log_dir>/<name>.log``. Startup waits for ``GET /health`` to
answer 200; a server that exits or is not healthy within ``startup_timeout`` raises a
``BenchError`` carrying the tail of its log. Stopping sends SIGTERM to the process group, then
SIGKILL after a grace period. Both engines get the same model file, the same number of
concurrent requests and the same context per request (``context_length``).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from radixserve.bench.client import BenchError
from radixserve.config import parse_bytes

RADIX_SYSTEMS: dict[str, tuple[str, ...]] = {
    "radix": ("--schedule-policy", "lpm"),
    "no-cache": ("--disable-prefix-caching",),
    "fcfs": ("--schedule-policy", "fcfs"),
    "dfs-weight": ("--schedule-policy", "dfs-weight"),
    "radix-nodrafts": ("--schedule-policy", "lpm", "--draft-sources", "none"),
    "radix-alldrafts": ("--schedule-policy", "lpm", "--draft-sources", "grammar,text,cache"),
}
FLEET_POLICIES = ("cache-aware", "round-robin", "least-load", "consistent-hash", "power-of-two")
FLEET_SYSTEMS = tuple(f"fleet-{p}" for p in FLEET_POLICIES)
SYSTEMS = (*RADIX_SYSTEMS, "llamacpp", *FLEET_SYSTEMS, "single-big")
LOG_TAIL_LINES = 30
STOP_GRACE_S = 15.0


@dataclass
class ServerSettings:
    model: str | None = None  # .gguf file or HF directory; None: the default model
    slots: int = 4  # concurrent requests each server must take at once
    context_length: int = 4096  # tokens of context per request
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)  # llama.cpp CPU threads
    radix_args: tuple[str, ...] = ()  # extra `radixserve serve` flags
    llamacpp_args: tuple[str, ...] = ()  # extra `llamacpp_server` flags (``--spec ngram_mod``)
    startup_timeout: float = 300.0
    log_dir: Path = Path(".")
    instances: int = 2  # fleet systems: N
    instance_kv_tokens: int | None = None  # KV pool of each fleet instance
    instance_host_kv_memory: int | str | None = None  # host tier of each fleet instance

    def __post_init__(self) -> None:
        for name in ("slots", "context_length", "threads", "instances"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.startup_timeout > 0:
            raise ValueError(f"startup_timeout must be > 0, got {self.startup_timeout}")
        if self.instance_host_kv_memory is not None:
            try:
                self.instance_host_kv_memory = parse_bytes(self.instance_host_kv_memory)
            except ValueError as e:
                raise ValueError(f"instance_host_kv_memory: {e}") from e
            if self.instance_host_kv_memory <= 0:
                raise ValueError("instance_host_kv_memory must be positive")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_path(model: str | None) -> str:
    """The GGUF file llama.cpp should serve: ``model`` itself or the default model."""
    from radixserve.model.loader import ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(model)
    except (ModelNotFoundError, ValueError) as e:
        raise BenchError(str(e)) from e
    if path.suffix != ".gguf":
        raise BenchError(f"llamacpp serves .gguf files only; --model {model} is not one")
    return str(path)


def command(system: str, settings: ServerSettings) -> Callable[[int], list[str]]:
    """The argv that starts ``system`` on a given port."""
    if system == "llamacpp":
        if importlib.util.find_spec("xllamacpp") is None:
            raise BenchError("the llamacpp system needs xllamacpp: run `pip install xllamacpp`")
        model = gguf_path(settings.model)
        return lambda port: [
            sys.executable, "-m", "radixserve.bench.llamacpp_server", "--model", model,
            "--port", str(port), "--parallel", str(settings.slots),
            "--ctx-per-slot", str(settings.context_length), "--threads", str(settings.threads),
            *settings.llamacpp_args,
        ]  # fmt: skip
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    model = ("--model", settings.model) if settings.model else ()
    pool, host = settings.instance_kv_tokens, settings.instance_host_kv_memory
    if system in FLEET_SYSTEMS:
        flags = ("--dp", str(settings.instances), "--router-policy", system.split("-", 1)[1])
        flags += ("--max-total-tokens", str(pool)) if pool else ()
        flags += ("--host-kv-memory", str(host)) if host else ()
    elif system == "single-big":
        if pool is None:
            raise BenchError("single-big needs --instance-kv-tokens (its pool is N times that)")
        flags = ("--max-total-tokens", str(pool * settings.instances))
        flags += ("--host-kv-memory", str(host * settings.instances)) if host else ()
    elif host is not None:
        raise BenchError(f"--instance-host-kv-memory is for fleet-* and single-big, not {system}")
    else:
        flags = RADIX_SYSTEMS[system]
    return lambda port: [
        sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1", "--port",
        str(port), *model, "--max-model-len", str(settings.context_length),
        *flags, *settings.radix_args,
    ]  # fmt: skip


class ManagedServer:
    """A server child process for the span of a ``with`` block; ``base_url`` once healthy."""

    def __init__(
        self, name: str, argv_for_port: Callable[[int], list[str]], settings: ServerSettings
    ):
        self.name, self.settings = name, settings
        self.port = free_port()
        self.argv = argv_for_port(self.port)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(settings.log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # from the process start to a healthy /health

    def __enter__(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def rss_bytes(self) -> int:
        """Resident memory of the server's process group (the server and its engine)."""
        return sum(self.group_rss().values())

    def largest_child_rss_bytes(self) -> int:
        """Resident memory of the server's largest child process (radixserve's engine)."""
        return max((rss for pid, rss in self.group_rss().items() if pid != self.proc.pid),
                   default=0)  # fmt: skip

    def group_rss(self) -> dict[int, int]:
        """Resident bytes of each process of the server's process group."""
        if self.proc is None:
            return {}
        out = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.proc.pid:  # the process group id
                    pid = int(stat.parent.name)
                    out[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # rss in pages
            except (OSError, IndexError, ValueError):
                continue  # a process that ended meanwhile
        return out

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise BenchError(
                    f"{self.name} exited with code {self.proc.returncode} while starting"
                    f"{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise BenchError(
            f"{self.name} was not healthy within {self.settings.startup_timeout:g} s"
            f"{self.log_tail()}"
        )

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            return ""
        return f"; last lines of {self.log_path}:\n" + "\n".join(lines)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)  # the group: the server and its engine process
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
