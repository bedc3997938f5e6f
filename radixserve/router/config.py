"""RouterConfig: who may call the router, how it calls its workers, and its limits; and
the ``router`` flags that set it (also read by ``serve --dp``).

Keys, as on the server (``api/guard.py`` enforces both): any of ``api_keys`` (tenants)
opens the inference endpoints (``/v1/*``, ``/generate``); ``admin_key`` alone opens the
management endpoints (``/workers``, ``/flush_cache``, ``/metrics``), which are closed
whenever keys are configured and it is not. Without any key everything is open.

Workers never see a tenant's key. Every call the router makes to a worker (forwarded
requests, ``/v1/models``, ``/kv_events``, ``/health``, ``/flush_cache``) carries
``worker_api_key``, which should be the workers' ``--admin-key``: with
``salt_from_api_key`` the router names the caller's tenant in ``X-Radixserve-Tenant``, which
a worker honours only from the holder of its admin key.

The router subscribes to its workers' KV events over ZeroMQ with its own CurveZMQ key pair
(``zmq_key``: a key file; None: ``$RADIXSERVE_ZMQ_KEY``, else the user's default key file;
``links/keys.py``), expecting each worker's server key as its ``/kv_events`` says; only with
``zmq_unauthenticated`` does it read plain sockets (and only those).

HTTPS: ``tls`` is the router's own front (as the server's, ``links/tls.py``); ``worker_tls``
checks workers reached over ``https://`` (their certificates against the system's trust
store or ``--worker-ca-certs``, with the router's client certificate where they require one).

``first_byte_timeout``: seconds a worker may take to send the first bytes of its answer
(the whole answer, for one that is not streamed); past it the worker is probed, and if it
does not answer its health check it counts as hung, leaves the fleet until a health check
passes, and the request is retried on another worker (one that answers is only busy).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Any

from radixserve.api.config import TENANT_HEADER, ServerConfig
from radixserve.cli_options import flag
from radixserve.config import LinkConfig, parse_bytes
from radixserve.links.flags import zmq_error
from radixserve.links.keys import ZmqSecurity
from radixserve.links.tls import ClientTLS, ServerTLS

ADMIN_PATHS = ("/workers", "/flush_cache", "/metrics")


@dataclass
class RouterConfig:
    api_keys: list[str] = field(default_factory=list)
    admin_key: str | None = None
    worker_api_key: str | None = None
    salt_from_api_key: bool = False
    max_request_bytes: int | str = ServerConfig.max_request_bytes  # the server's default
    first_byte_timeout: float = 300.0
    zmq_key: str | None = None
    zmq_unauthenticated: bool = False
    tls: ServerTLS = field(default_factory=ServerTLS)
    worker_tls: ClientTLS = field(default_factory=ClientTLS)

    def __post_init__(self) -> None:
        self.max_request_bytes = parse_bytes(self.max_request_bytes)
        self.guard_config()  # the server's checks of keys and limits
        if self.worker_api_key == "":
            raise ValueError("worker_api_key must not be empty")
        if self.salt_from_api_key and self.worker_api_key is None:
            raise ValueError(
                "salt_from_api_key needs worker_api_key (the workers' admin key), so that "
                "the workers accept the tenant the router names"
            )
        if not (0 < self.first_byte_timeout < math.inf):
            raise ValueError(f"first_byte_timeout must be > 0, got {self.first_byte_timeout}")

    def zmq_security(self) -> ZmqSecurity:
        """The keys of the router's ZeroMQ clients, read now (a ValueError names the fault)."""
        return LinkConfig(self.zmq_key, (), self.zmq_unauthenticated).security()

    def guard_config(self) -> ServerConfig:
        """The settings the server's ``Guard`` reads."""
        return ServerConfig(
            api_keys=list(self.api_keys),
            admin_key=self.admin_key,
            salt_from_api_key=self.salt_from_api_key,
            max_request_bytes=self.max_request_bytes,
        )

    def worker_headers(self, tenant: str | None = None) -> dict[str, str]:
        """The credential (and tenant) of a call from the router to a worker."""
        headers = {}
        if self.worker_api_key is not None:
            headers["authorization"] = f"Bearer {self.worker_api_key}"
        if tenant is not None:
            headers[TENANT_HEADER] = tenant
        return headers


def add_router_access_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("keys, tenants and limits")
    g.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="a tenant's key: 'Authorization: Bearer KEY' opens the inference endpoints "
        "(never forwarded to the workers); repeat for several keys (default: "
        "$RADIXSERVE_API_KEY, comma-separated; unset: no key)",
    )
    g.add_argument(
        "--admin-key",
        default=os.environ.get("RADIXSERVE_ADMIN_KEY"),
        help="the key of /workers, /flush_cache and /metrics; with API keys and no admin key "
        "those are closed (default: $RADIXSERVE_ADMIN_KEY)",
    )
    g.add_argument(
        "--worker-api-key",
        default=os.environ.get("RADIXSERVE_WORKER_API_KEY"),
        metavar="KEY",
        help="the key the router sends on every call to a worker: the workers' --admin-key "
        "(default: $RADIXSERVE_WORKER_API_KEY; unset: none)",
    )
    g.add_argument(
        "--salt-from-api-key",
        action="store_true",
        help="the workers run with --salt-from-api-key: each key's prompts are cached in its "
        "own namespace (the router names the tenant to the workers; needs --worker-api-key)",
    )
    g.add_argument(
        "--max-request-bytes",
        default=ServerConfig.max_request_bytes,
        help="largest request body (413 beyond); default %(default)s",
    )
    g.add_argument(
        "--first-byte-timeout",
        type=float,
        default=RouterConfig.first_byte_timeout,
        metavar="SECONDS",
        help="seconds a worker may take to start its answer (a whole answer, when not "
        "streamed) before it is probed; one that fails the probe counts as hung and the "
        "request is retried on another worker; default %(default)s",
    )
    g.add_argument(
        "--worker-ca-certs",
        metavar="FILE",
        help="check https:// workers' certificates against the CAs in this file (default: "
        "the system's trust store)",
    )
    g.add_argument(
        "--worker-cert",
        metavar="FILE",
        help="the router's client certificate, for workers started with --ssl-ca-certs",
    )
    g.add_argument("--worker-key", metavar="FILE", help="the private key of --worker-cert")


def router_config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, **overrides: Any
) -> RouterConfig:
    """The ``RouterConfig`` the flags give; an error naming the flag if they do not fit."""
    options = dict(
        api_keys=api_keys_from_args(args),
        admin_key=args.admin_key,
        worker_api_key=getattr(args, "worker_api_key", None),
        salt_from_api_key=args.salt_from_api_key,
        max_request_bytes=args.max_request_bytes,
        first_byte_timeout=getattr(args, "first_byte_timeout", RouterConfig.first_byte_timeout),
        zmq_key=args.zmq_key,
        zmq_unauthenticated=args.zmq_unauthenticated,
    )
    try:
        config = RouterConfig(**{**options, **overrides})
    except ValueError as e:
        message = str(e)
        if "memory size" in message:
            message = f"--max-request-bytes: {message}"
        for name in sorted(options, key=len, reverse=True):
            message = message.replace(name, flag(name))
        parser.error(message)
    try:
        config.zmq_security()
    except ValueError as e:
        parser.error(zmq_error(e))
    try:
        config.tls = ServerTLS(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs)
        config.worker_tls = ClientTLS(*(getattr(args, f"worker_{n}", None)
                                        for n in ("ca_certs", "cert", "key")))  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    return config


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """``--api-key`` values, else ``$RADIXSERVE_API_KEY`` (comma-separated), as the server."""
    if args.api_keys:
        return list(args.api_keys)
    env = os.environ.get("RADIXSERVE_API_KEY", "")
    return [k.strip() for k in env.split(",") if k.strip()]
