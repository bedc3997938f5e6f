"""``radixserve serve``: start the engine process, then serve HTTP once the model is loaded.

The listening socket is bound first (a busy port fails at once, before the model loads);
the address is logged when the engine reports ready. Binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from radixserve.cli import add_engine_args, engine_config_from_args
from radixserve.config import EngineConfig

log = logging.getLogger("radixserve")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve the OpenAI-compatible HTTP API (chat and text "
        "completions, streaming), native /generate, /flush_cache, /cache and "
        "Prometheus /metrics.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind; default %(default)s")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port to bind (0: any free port); default %(default)s",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RADIXSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $RADIXSERVE_API_KEY, unset: no key)",
    )
    p.add_argument(
        "--served-model-name", help="the model id clients send (default: the model file's name)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    p.set_defaults(func=cmd_serve, parser=p)


def cmd_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {args.port}")
    config = engine_config_from_args(parser, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        sock = socket.create_server((args.host, args.port), reuse_port=False)
    except OSError as e:
        parser.error(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    try:
        return asyncio.run(serve(config, sock, args))
    except KeyboardInterrupt:
        return 0


async def serve(config: EngineConfig, sock: socket.socket, args: argparse.Namespace) -> int:
    import uvicorn

    from radixserve.model.loader import ModelNotFoundError, resolve_model_path
    from radixserve.model.tokenizer import Tokenizer
    from radixserve.server.app import create_app
    from radixserve.server.engine_client import EngineClient, EngineDeadError

    try:
        model_path = resolve_model_path(config.model)
    except ModelNotFoundError as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr)
        return 2
    client = EngineClient(
        config, on_stats=lambda stats, after_step: None, log_level=log.getEffectiveLevel()
    )
    try:
        start = asyncio.create_task(client.start())
        tokenizer = await asyncio.to_thread(Tokenizer.from_model_path, model_path, [])
        info = await start
    except EngineDeadError as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr)
        await client.close()
        return 1
    name = args.served_model_name or info.model_name
    app = create_app(client, tokenizer, name, args.api_key)
    host, port = sock.getsockname()[:2]
    log.info(
        "model %s loaded; KV pool of %d tokens (%.2f GiB); schedule policy %s; prefix caching %s",
        name,
        info.kv_capacity_tokens,
        info.kv_bytes / 2**30,
        config.schedule_policy,
        "on" if config.enable_prefix_caching else "off",
    )
    if info.disaggregation is not None:
        d = info.disaggregation
        where = f"; KV transfer endpoint {d.endpoint}" if d.endpoint else ""
        log.info("disaggregation mode %s%s", d.mode, where)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False))
    # uvicorn shuts down gracefully on SIGTERM, then raises it again; let that end in an
    # exception (not a hard kill) so the engine process and its sockets are cleaned up below.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    print(f"radixserve listening on http://{host}:{port}", flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        await client.close()
    return 0


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)
