"""``radixserve serve``: one server, or with ``--dp N`` N servers behind the router.

The ``serve`` parser is the server's own (``server.cli``) with the fleet's flags added:
``--dp`` and the router's policy flags (``--router-policy``, ``--gate-tokens``...). Every
flag is checked and the port bound before anything starts, whichever way it runs.
"""

from __future__ import annotations

import argparse

from radixserve.router.cli import add_router_policy_args
from radixserve.server import cli as server_cli


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = server_cli.add_serve_parser(sub)
    p.add_argument_group("fleet").add_argument(
        "--dp",
        type=int,
        default=1,
        help="run N engine instances (CPU threads split between them; one per GPU) and the "
        "router in front, on this port; default %(default)s",
    )
    add_router_policy_args(p, prefix="router-")
    p.set_defaults(func=cmd_serve, parser=p)


def cmd_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.dp < 1:
        parser.error(f"--dp must be at least 1, got {args.dp}")
    if args.dp > 1 and args.step_trace is not None:
        parser.error("--step-trace traces one engine; it cannot be combined with --dp")
    config, server_config, sock = server_cli.checked_serve_args(parser, args)
    if args.dp > 1:
        from radixserve.fleet.dp_launch import cmd_dp

        return cmd_dp(parser, args, sock)
    return server_cli.run_server(config, server_config, sock, args.log_level)
