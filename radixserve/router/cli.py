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
import math
import signal
import socket
import sys

from radixserve.cli_options import flag
from radixserve.links.flags import add_tls_args, add_zmq_args
from radixserve.router.config import RouterConfig, add_router_access_args, router_config_from_args
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
    "share_ratio": "cache-aware: a prefix holder whose recent share (--share-measure) exceeds "
    "RATIO x the fleet's mean is skipped (fair share; 'off' turns it off)",
    "share_half_life": "cache-aware: seconds in which what --share-ratio counts decays by half",
    "share_measure": "cache-aware: what --share-ratio balances: 'work' (routed uncached tokens "
    "+ --decode-weight per request) or 'occupancy' (seconds each worker had a request in "
    "flight, long answers included)",
    "share_noise": "cache-aware, occupancy: standard deviations of count noise a worker may "
    "exceed RATIO x the mean by before it is skipped",
}


def ratio_or_off(value: str) -> float:
    """``--share-ratio``: a number, or ``off`` (infinity: the gate never fires)."""
    return math.inf if value.strip().lower() == "off" else float(value)


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
            flag(f.name), dest=f"policy_{f.name}", default=None,
            type=ratio_or_off if f.name == "share_ratio" else type(f.default),
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
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        help="prefill/decode mode: a prefill instance's base URL (serve --disaggregation-mode "
        "prefill); needs --decode",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        help="prefill/decode mode: a decode instance's base URL (serve --disaggregation-mode "
        "decode)",
    )
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=64,
        help="prefill/decode mode: a request whose uncached part on its decode instance is "
        "shorter is prefilled there, without a prefill instance; default %(default)s",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind; default %(default)s")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free); default %(default)s")
    p.add_argument(
        "--model", help="the model file the workers serve, for its tokenizer (default: SmolLM2)"
    )
    add_router_access_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of randomised policies")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_router_policy_args(p)
    add_zmq_args(p, binds=False)
    add_tls_args(p)
    p.set_defaults(func=cmd_router, parser=p)


def bind(parser: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {port}")
    try:
        return socket.create_server((host, port), reuse_port=False)
    except OSError as e:
        parser.error(f"cannot listen on {host}:{port}: {e.strerror}")


def cmd_router(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.worker and (args.prefill or args.decode):
        parser.error("give --worker, or --prefill and --decode (prefill/decode mode), not both")
    if bool(args.prefill) != bool(args.decode):
        parser.error("prefill/decode mode needs at least one --prefill and one --decode")
    if args.local_prefill_tokens < 0:
        parser.error(f"--local-prefill-tokens must be >= 0, got {args.local_prefill_tokens}")
    config = policy_config_from_args(parser, args)
    access = router_config_from_args(parser, args)
    sock = bind(parser, args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        return asyncio.run(
            serve_router(sock, args.worker or args.decode, args.policy, config, args.model,
                         access, args.log_level, args.seed, args.prefill,
                         args.local_prefill_tokens)
        )  # fmt: skip
    except KeyboardInterrupt:
        return 0


async def serve_router(
    sock: socket.socket,
    worker_urls: list[str],
    policy_name: str,
    config: PolicyConfig,
    model: str | None,
    access: RouterConfig,
    log_level: str = "info",
    seed: int = 0,
    prefill_urls: list[str] | None = None,
    local_prefill_tokens: int = 64,
) -> int:
    """Serve the router over ``worker_urls``; with ``prefill_urls``, in prefill/decode mode
    (``worker_urls`` are then the decode instances)."""
    import httpx
    import uvicorn

    from radixserve.model.loader import ModelNotFoundError, resolve_model_path
    from radixserve.model.tokenizer import Tokenizer
    from radixserve.router.app import create_router_app
    from radixserve.router.pd_pools import PDPools
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
    # every call to a worker carries the worker credential, never a tenant's key
    headers = access.worker_headers()
    security = access.zmq_security()
    verify = access.worker_tls.context()  # https:// workers: certificates always checked
    async with httpx.AsyncClient(
        limits=limits, timeout=timeout, headers=headers, verify=verify
    ) as client:
        if prefill_urls:
            fleet = PDPools(client, policy_name, config, seed, local_prefill_tokens, security)
            pool, prefill_pool = fleet.decode, fleet.prefill
        else:
            policy = make_policy(policy_name, config, seed)
            fleet = pool = WorkerPool(policy, client, security)
            prefill_pool = None
        try:
            for url in prefill_urls or ():
                await fleet.add_prefill(url)
            for url in worker_urls:
                await (fleet.add_decode(url) if prefill_urls else pool.add(url))
        except WorkerError as e:
            print(f"radixserve router: error: {e}", file=sys.stderr)
            await fleet.close()
            return 2
        app = create_router_app(pool, tokenizer, access, prefill_pool)
        fleet.start()
        server = uvicorn.Server(
            uvicorn.Config(
                app, log_level=log_level, access_log=False, **access.tls.uvicorn_options()
            )  # fmt: skip
        )
        signal.signal(signal.SIGTERM, _raise_system_exit)
        host, port = sock.getsockname()[:2]
        workers = f"{len(pool.workers)} workers"
        if prefill_pool is not None:
            workers = f"{len(prefill_pool.workers)} prefill, {len(pool.workers)} decode"
        print(f"radixserve router listening on {access.tls.scheme}://{host}:{port} "
              f"({policy_name}, {workers})", flush=True)  # fmt: skip
        try:
            await server.serve(sockets=[sock])
        finally:
            await fleet.close()
    return 0


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)
