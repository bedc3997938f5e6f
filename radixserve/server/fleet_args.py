"""``serve`` flags for running in a fleet: KV events for a router, and ``--dp N``."""

from __future__ import annotations

import argparse
from typing import Any


def add_fleet_args(parser: argparse.ArgumentParser) -> None:
    from radixserve.router.cli import add_router_policy_args

    g = parser.add_argument_group("fleet")
    g.add_argument(
        "--kv-events-endpoint",
        help="publish KV events (vLLM's format) on this ZeroMQ address, e.g. "
        "tcp://127.0.0.1:5557 (port 0: a free port; GET /kv_events tells which)",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        help="answer replay and dump requests for KV events here, e.g. tcp://127.0.0.1:5558",
    )
    g.add_argument(
        "--kv-events-block-size",
        type=int,
        help="tokens per KV event block (default: 16, rounded up to whole pages)",
    )
    g.add_argument(
        "--dp",
        type=int,
        default=1,
        help="run N engine instances (CPU threads split between them; one per GPU) and the "
        "router in front, on this port; default %(default)s",
    )
    add_router_policy_args(parser, prefix="router-")


def kv_event_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    if args.dp < 1:
        parser.error(f"--dp must be at least 1, got {args.dp}")
    return {
        "kv_events_endpoint": args.kv_events_endpoint,
        "kv_events_replay_endpoint": args.kv_events_replay_endpoint,
        "kv_events_block_size": args.kv_events_block_size,
    }
