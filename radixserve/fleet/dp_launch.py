"""``radixserve serve --dp N``: N engine servers behind the router, on one port.

Each instance is a ``radixserve serve`` child on a free loopback port with the parent's flags
(minus the ones that place it), publishing KV events on free loopback ports. On CPU each gets
``cores / N`` threads (``OMP_NUM_THREADS``); on GPUs (``--device cuda``) instance ``i`` gets
``cuda:i``. KV pool options (``--max-total-tokens``, ``--kv-cache-memory``) apply per
instance. The router runs in this process with the parent's keys (tenants' ``--api-key``,
``--admin-key`` for its management endpoints); the instances' admin key is a secret drawn
at start, the router's credential with them. A ``Supervisor`` restarts an instance that
dies (with back-off; the router's ``/health`` says ``degraded`` meanwhile); the children
die with this process (PR_SET_PDEATHSIG) and are stopped when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import socket
import sys
import time

import httpx

from radixserve.cli_options import flag
from radixserve.fleet.supervisor import Supervisor
from radixserve.router.cli import policy_config_from_args, serve_router
from radixserve.router.config import router_config_from_args
from radixserve.router.policy import PolicyConfig
from radixserve.server.engine_process import die_with_parent

PLACEMENT_FLAGS = {"--dp", "--port", "--host", "--device", "--router-policy", "--admin-key",
                   "--kv-events-endpoint", "--kv-events-replay-endpoint"}  # fmt: skip


def child_argv(argv: list[str]) -> list[str]:
    """The parent's ``serve`` flags without those that place an instance or tune routing."""
    drop = PLACEMENT_FLAGS | {flag(f.name) for f in dataclasses.fields(PolicyConfig)}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_dp(parser: argparse.ArgumentParser, args: argparse.Namespace, sock: socket.socket) -> int:
    from radixserve.kvevents.hashing import default_block_size

    n = args.dp
    block = args.kv_events_block_size or default_block_size(args.page_size)
    config = policy_config_from_args(parser, args, block_size=block)
    flags = child_argv(args.argv[1:] if args.argv and args.argv[0] == "serve" else args.argv)
    threads = max(1, (os.cpu_count() or 1) // n)
    # the instances' admin key: the router's credential, known to no one else
    secret = secrets.token_urlsafe(24)
    access = router_config_from_args(parser, args, worker_api_key=secret)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "RADIXSERVE_ADMIN_KEY": secret}
    commands, urls = [], []
    for i in range(n):
        port = free_port()
        device = f"cuda:{i}" if args.device.startswith("cuda") else args.device
        argv = [sys.executable, "-m", "radixserve.cli", "serve", *flags, "--host",
                "127.0.0.1", "--port", str(port), "--device", device,
                "--kv-events-endpoint", "tcp://127.0.0.1:0",
                "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]  # fmt: skip
        commands.append((argv, env))
        urls.append(f"http://127.0.0.1:{port}")
    supervisor = Supervisor(commands, preexec_fn=die_with_parent)
    try:
        supervisor.start()
        _wait_healthy(supervisor, urls, timeout=600.0)
        supervisor.watch()
        print(f"radixserve: {n} instances ready ({threads} threads each)", flush=True)
        return asyncio.run(
            serve_router(sock, urls, args.policy, config, args.model, access, args.log_level)
        )
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        supervisor.stop()


def _wait_healthy(supervisor: Supervisor, urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(range(len(urls)))
    while pending:
        for i in list(pending):
            proc = supervisor.children[i].proc
            if proc.poll() is not None:
                raise RuntimeError(f"instance {i} exited with code {proc.returncode}")
            try:
                if httpx.get(f"{urls[i]}/health", timeout=2.0).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"instances {sorted(pending)} did not start in {timeout:g} s")
        time.sleep(0.25)
