"""``serve`` flags that publish the engine's KV events, for a router's index."""

from __future__ import annotations

import argparse
from typing import Any


def add_kv_event_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV events")
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


def kv_event_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "kv_events_endpoint": args.kv_events_endpoint,
        "kv_events_replay_endpoint": args.kv_events_replay_endpoint,
        "kv_events_block_size": args.kv_events_block_size,
    }
