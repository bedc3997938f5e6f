"""``radixserve router``: an OpenAI-compatible front over radixserve workers.

Workers are given as ``--worker URL`` (repeatable) or added at run time (``POST /workers``).
The router needs the workers' tokenizer (``--model``, the same model file they serve) to hash
prompts the way their trees do. Every ``PolicyConfig`` field is a flag (``--gate-tokens``...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys

from radixserve.cli import flag
from radixserve.router.policy import POLICIES, PolicyConfig

log = logging.getLogger("radixserve")
POLICY_HELP = {
    "block_size": "tokens per hashed block; must equal the workers' KV event block size",
    "decode_weight": "load of one request in flight, in prompt tokens",
    "gate_ratio": "cache-aware: a prefix holder loaded above RATIO x least load + "
    "--gate-tokens is skipped for this request",
    "gate_tokens": "cache-aware: see --gate-ratio",
    "candidates": "cache-aware: prefix holders scored per request",
    "approx_ttl": "seconds a routed prefix counts as cached until the worker's event confirms it",
    "approx_ttl_no_events": "the same, for workers without KV events",
    "host_cost": "cost of a token cached on host memory, relative to recomputing it",
    "storage_cost": "cost of a token cached on the storage tier",
    "hash_blocks": "consistent-hash: blocks of the prompt that pick the worker",
    "virtual_nodes": "consistent-hash: ring points per worker",
}


def add_router_policy_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The policy and its tuning flags; with a ``prefix`` (``serve --dp``) the block size is
    the engines' own and has no flag."""
    group = parser.add_argument_group("routing policy" + (" (with --dp)" if prefix else ""))
    group.add_argument(
        f"--{prefix}policy",
        dest="policy",
        default="cache-aware",
        choices=POLICIES,
        help="how requests are spread; default %(default)s",
    )
    for f in dataclasses.fields(PolicyConfig):
        if prefix and f.name == "block_size":
            continue
        group.add_argument(
            flag(f.name), dest=f"policy_{f.name}", type=type(f.default), default=None,
            metavar=f.name.split("_")[-1].upper(),
            help=f"{POLICY_HELP[f.name]} (default {f.default})",
        )  # fmt: skip


def policy_config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, **extra: int
) -> PolicyConfig:
    given = {
        f.name: getattr(args, f"policy_{f.name}")
        for f in dataclasses.fields(PolicyConfig)
        if getattr(args, f"policy_{f.name}", None) is not None
    }
    try:
        return PolicyConfig(**given, **extra)
    except ValueError as e:
        message = str(e)
        for name in given:
            message = message.replace(name, flag(name))
        parser.error(message)


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "router",
        help="route requests over several radixserve servers by cache affinity and load",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
    )
    p.add_argument("--worker", action="append", default=[], help="a worker's base URL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; default %(default)s")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free); default %(default)s")
    p.add_argument(
        "--model", help="the model file the workers serve, for its tokenizer (default: SmolLM2)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RADIXSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (forwarded to the workers)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of randomised policies")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_router_policy_args(p)
    p.set_defaults(func=cmd_router, parser=p)


def bind(parser: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {port}")
    try:
        return socket.create_server((host, port), reuse_port=False)
    except OSError as e:
        parser.error(f"cannot listen on {host}:{port}: {e.strerror}")


def cmd_router(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    config = policy_config_from_args(parser, args)
    sock = bind(parser, args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        return asyncio.run(
            serve_router(sock, args.worker, args.policy, config, args.model, args.api_key,
                         args.log_level, args.seed)
        )  # fmt: skip
    except KeyboardInterrupt:
        return 0


async def serve_router(
    sock: socket.socket,
    worker_urls: list[str],
    policy_name: str,
    config: PolicyConfig,
    model: str | None,
    api_key: str | None,
    log_level: str = "info",
    seed: int = 0,
) -> int:
    import httpx
    import uvicorn

    from radixserve.model.loader import ModelNotFoundError, resolve_model_path
    from radixserve.model.tokenizer import Tokenizer
    from radixserve.router.app import create_router_app
    from radixserve.router.policy import make_policy
    from radixserve.router.workers import WorkerError, WorkerPool

    try:
        tokenizer = await asyncio.to_thread(
            Tokenizer.from_model_path, resolve_model_path(model), []
        )
    except ModelNotFoundError as e:
        print(f"radixserve router: error: {e}", file=sys.stderr)
        return 2
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    timeout = httpx.Timeout(None, connect=5.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        pool = WorkerPool(make_policy(policy_name, config, seed), client)
        try:
            for url in worker_urls:
                await pool.add(url)
        except WorkerError as e:
            print(f"radixserve router: error: {e}", file=sys.stderr)
            await pool.close()
            return 2
        app = create_router_app(pool, tokenizer, api_key)
        pool.start()
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False))
        signal.signal(signal.SIGTERM, _raise_system_exit)
        host, port = sock.getsockname()[:2]
        print(f"radixserve router listening on http://{host}:{port} "
              f"({policy_name}, {len(pool.workers)} workers)", flush=True)  # fmt: skip
        try:
            await server.serve(sockets=[sock])
        finally:
            await pool.close()
    return 0


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)
