"""Real servers and routers on free loopback ports, for the fleet tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import httpx


class Proc:
    """A ``radixserve`` child process; ``url`` once it printed its listening line."""

    def __init__(self, args: list[str], marker: str):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.cli", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        self.args, self.marker = args, marker
        self.lines: list[str] = []
        self.url = None

    def wait(self, timeout: float = 240.0) -> Proc:
        args, marker = self.args, self.marker
        deadline = time.monotonic() + timeout
        while self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError(f"{args[0]} exited:\n" + "".join(self.lines[-30:]))
            self.lines.append(line)
            if line.startswith(marker):
                self.url = line.split()[len(marker.split())]
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[0]} did not start:\n" + "".join(self.lines[-30:]))
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(20)


def start_worker(model_dir, *extra: str) -> Proc:
    """Started, not yet listening: ``.wait()`` for it (start several first, then wait)."""
    return Proc(
        ["serve", "--model", str(model_dir), "--port", "0", "--log-level", "warning",
         "--dtype", "float32", "--max-total-tokens", "4096", "--kv-events-endpoint",
         "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0", *extra],
        "radixserve listening on",
    )  # fmt: skip


def start_dp(model_dir, n: int, *extra: str) -> Proc:
    """``radixserve serve --dp N``: N instances and the router in front, on one port."""
    return Proc(
        ["serve", "--dp", str(n), "--model", str(model_dir), "--port", "0", "--log-level",
         "warning", "--dtype", "float32", "--max-total-tokens", "4096", *extra],
        "radixserve router listening on",
    ).wait()  # fmt: skip


def pid_of_server(url: str) -> int:
    """The process serving ``url`` (a ``serve`` child started with ``--port PORT``)."""
    port = url.rsplit(":", 1)[1]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "serve" in argv and "--port" in argv and argv[argv.index("--port") + 1] == port:
            return int(entry)
    raise LookupError(f"no server process for {url}")


def start_router(model_dir, workers: list[str], *extra: str) -> Proc:
    args = ["router", "--model", str(model_dir), "--port", "0", "--log-level", "warning"]
    for w in workers:
        args += ["--worker", w]
    return Proc([*args, *extra], "radixserve router listening on").wait()


@contextlib.contextmanager
def stopping(*procs: Proc):
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def idle(router_url: str, headers: dict[str, str] | None = None) -> bool:
    workers = httpx.get(f"{router_url}/workers", headers=headers, timeout=10).json()["workers"]
    return all(w["running"] == 0 and w["load"] in (0, 0.0, None) for w in workers)
