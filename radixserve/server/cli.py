"""``radixserve serve``: start the engine process, then serve HTTP once the model is loaded.

The listening socket is bound first (a busy port fails at once, before the model loads);
the address is logged when the engine reports ready. Binds to 127.0.0.1 unless told otherwise.
Exits 0 after SIGTERM (running requests get ``--shutdown-timeout`` seconds to finish), 1 if
the engine cannot start or keeps dying (after ``--engine-restarts`` restarts), so that a
supervisor (systemd, Kubernetes) can act.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, NoReturn

from radixserve.api.config import ServerConfig, parse_sampling_overrides
from radixserve.cli_options import add_engine_args, engine_config_from_args
from radixserve.config import EngineConfig
from radixserve.server.event_args import add_kv_event_args, kv_event_options

if TYPE_CHECKING:
    from pathlib import Path

    from radixserve.model.generation_defaults import GenerationDefaults
    from radixserve.model.tokenizer import Tokenizer

log = logging.getLogger("radixserve")


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``serve`` command of one server (``fleet.cli`` adds ``--dp`` to it)."""
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
        "--served-model-name", help="the model id clients send (default: the model file's name)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--step-trace",
        metavar="PATH",
        help="append every engine step and admission, timed, to this file as JSON lines "
        "(what `radixserve simulate fit --server` measures); default: off",
    )
    add_security_args(p)
    add_limit_args(p)
    add_engine_args(p)
    add_kv_event_args(p)
    p.set_defaults(func=cmd_serve, parser=p)
    return p


def add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("keys and tenants")
    g.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health; repeat for "
        "several keys (default: $RADIXSERVE_API_KEY, comma-separated; unset: no key)",
    )
    g.add_argument(
        "--admin-key",
        default=os.environ.get("RADIXSERVE_ADMIN_KEY"),
        help="the key of /flush_cache, /clear_kv_storage, /cache, /debug/* and /kv_events, and "
        "of naming any prefill instance in X-Radixserve-Prefill; with API keys and no admin "
        "key those endpoints are closed (default: $RADIXSERVE_ADMIN_KEY)",
    )
    g.add_argument(
        "--trusted-prefill",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="decode instance: a prefill instance's KV endpoint (tcp://HOST:PORT) that any "
        "caller may name in X-Radixserve-Prefill, besides --prefill-endpoint; repeat for "
        "several. Others need the admin key (400 otherwise)",
    )
    g.add_argument(
        "--salt-from-api-key",
        action="store_true",
        help="give every API key its own cache namespace: tenants never share cached tokens",
    )
    g.add_argument(
        "--debug-cache-text",
        action="store_true",
        help="let /cache show the text of cached prefixes (default: counts and hashes only)",
    )


def add_limit_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("limits and defaults")
    g.add_argument(
        "--max-request-bytes",
        default=ServerConfig.max_request_bytes,
        help="largest request body (413 beyond); default %(default)s",
    )
    g.add_argument(
        "--max-request-sequences",
        type=int,
        default=d.max_request_sequences,
        help="most sequences (prompts x n) in one request; default %(default)s",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="most sequences waiting beyond the running batch (503 + Retry-After beyond); "
        "default %(default)s",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help="seconds SIGTERM waits for running requests; default %(default)s",
    )
    g.add_argument(
        "--engine-restarts",
        type=int,
        default=d.engine_restarts,
        help="restarts of a dead engine within 10 minutes before the server exits 1; "
        "default %(default)s",
    )
    g.add_argument(
        "--stored-responses",
        type=int,
        default=d.stored_responses,
        help="responses each tenant's /v1/responses keeps for previous_response_id (the "
        "oldest go first); default %(default)s",
    )
    g.add_argument(
        "--default-sampling",
        action="append",
        metavar="NAME=VALUE,...",
        help="sampling defaults over the model's own, e.g. temperature=0.2,top_p=0.9,"
        "max_tokens=512; a request's own values always win",
    )


SERVER_FLAGS = (
    "api_keys",
    "admin_key",
    "trusted_prefill",
    "salt_from_api_key",
    "debug_cache_text",
    "max_request_bytes",
    "max_request_sequences",
    "max_queued_requests",
    "shutdown_timeout",
    "engine_restarts",
    "stored_responses",
    "served_model_name",
)


def server_config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> ServerConfig:
    from radixserve.engine import SamplingParams

    options = {name: getattr(args, name) for name in SERVER_FLAGS}
    if options["api_keys"] is None:
        env = os.environ.get("RADIXSERVE_API_KEY", "")
        options["api_keys"] = [k.strip() for k in env.split(",") if k.strip()]
    sampling: dict = {}
    try:
        for text in args.default_sampling or []:
            sampling.update(parse_sampling_overrides(text))
        SamplingParams(**sampling)  # the values themselves, checked where requests are
    except ValueError as e:
        parser.error(f"--default-sampling: {e}")
    try:
        return ServerConfig.from_options(**options, default_sampling=sampling)
    except ValueError as e:
        message = str(e)
        for name in SERVER_FLAGS:
            message = message.replace(name, "--" + name.replace("_", "-"))
        parser.error(message.replace("--api-keys", "--api-key"))


def step_trace_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    if args.step_trace is None:
        return None
    try:
        with open(args.step_trace, "a"):
            pass
    except OSError as e:
        parser.error(f"--step-trace: cannot write {args.step_trace}: {e.strerror}")
    return os.path.abspath(args.step_trace)


def cmd_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    config, server_config, sock = checked_serve_args(parser, args)
    return run_server(config, server_config, sock, args.log_level)


def checked_serve_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[EngineConfig, ServerConfig, socket.socket]:
    """Every flag checked (errors name the flag), logging set up, the port bound."""
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {args.port}")
    config = engine_config_from_args(
        parser, args, step_trace=step_trace_path(parser, args), **kv_event_options(args)
    )
    server_config = server_config_from_args(parser, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        sock = socket.create_server((args.host, args.port), reuse_port=False)
    except OSError as e:
        parser.error(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    return config, server_config, sock


def run_server(
    config: EngineConfig, server_config: ServerConfig, sock: socket.socket, log_level: str
) -> NoReturn:
    """Serve on ``sock`` until SIGTERM or Ctrl-C, then end the process with the exit code."""
    try:
        code = asyncio.run(serve(config, server_config, sock, log_level))
    except KeyboardInterrupt:
        code = 0
    except SystemExit as e:  # SIGTERM, once the server has drained and closed the engine
        code = e.code if isinstance(e.code, int) else 0
    # Everything that needed closing is closed (the engine joined, its sockets and directory
    # gone); the interpreter's own teardown of torch and the tokenizer takes several seconds
    # on a busy machine, which a supervisor's stop deadline should not pay for.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


async def serve(
    config: EngineConfig, server_config: ServerConfig, sock: socket.socket, log_level: str
) -> int:
    from radixserve.model.loader import ModelNotFoundError, resolve_model_path
    from radixserve.server.engine_client import EngineClient, EngineDeadError

    try:
        model_path = resolve_model_path(config.model)
    except ModelNotFoundError as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr)
        return 2
    gave_up = asyncio.Event()
    client = EngineClient(
        config,
        on_stats=lambda stats, after_step: None,
        log_level=log.getEffectiveLevel(),
        max_restarts=server_config.engine_restarts,
        on_give_up=gave_up.set,
    )
    try:
        # the engine process starts first; this side imports its HTTP stack and builds its
        # tokenizer while the engine loads the model
        start = asyncio.create_task(client.start())
        await asyncio.sleep(0)  # start() spawns the engine before the imports below begin
        tokenizer, sampling = await asyncio.to_thread(_http_side, model_path)
        info = await start
    except EngineDeadError as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr)
        await client.close()
        return 1
    from radixserve.server.app import create_app

    server_config.served_model_name = server_config.served_model_name or info.model_name
    sampling.values.update(server_config.default_sampling)
    if server_config.default_sampling:
        sampling.source += " and --default-sampling"
    app = create_app(client, tokenizer, server_config, sampling)
    host, port = sock.getsockname()[:2]
    log.info(
        "model %s loaded; KV pool of %d tokens (%.2f GiB); schedule policy %s; prefix caching %s",
        server_config.served_model_name,
        info.kv_capacity_tokens,
        info.kv_bytes / 2**30,
        config.scheduler.schedule_policy,
        "on" if config.cache.enable_prefix_caching else "off",
    )
    if info.disaggregation is not None:
        d = info.disaggregation
        where = f"; KV transfer endpoint {d.endpoint}" if d.endpoint else ""
        log.info("disaggregation mode %s%s", d.mode, where)
    log.info("default sampling: %s", sampling.describe())
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=server_config.shutdown_timeout,
        )
    )
    # uvicorn shuts down gracefully on SIGTERM, then raises it again; let that end in an
    # exception (not a hard kill) so the engine process and its sockets are cleaned up below.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    print(f"radixserve listening on http://{host}:{port}", flush=True)
    watchdog = asyncio.create_task(_exit_when(gave_up, server))
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
        app.state.serving.close()
        await client.close()
    if gave_up.is_set():
        print(f"radixserve serve: error: {client.dead}", file=sys.stderr)
        return 1
    return 0


def _http_side(model_path: Path) -> tuple[Tokenizer, GenerationDefaults]:
    """The HTTP process's own start-up: its modules, the tokenizer, the sampling defaults."""
    import uvicorn  # noqa: F401  (imported here, off the path to the engine's start)

    import radixserve.server.app  # noqa: F401
    from radixserve.model.generation_defaults import generation_defaults
    from radixserve.model.tokenizer import Tokenizer

    return Tokenizer.from_model_path(model_path, []), generation_defaults(model_path)


async def _exit_when(event: asyncio.Event, server) -> None:
    """Stop serving once the engine supervisor gives up: a live server that answers 503
    forever helps no one, an exit lets a supervisor restart the whole thing."""
    await event.wait()
    server.should_exit = True


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)
