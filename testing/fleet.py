"""Real servers and routers on free loopback ports, for the fleet tests."""

from __future__ import annotations

import contextlib
import os
import time

import httpx

from radixserve.bench.processes import Proc

__all__ = ["Proc"]


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
