"""The flags of the links' settings, shared by ``serve`` and ``router``: ZeroMQ keys
(``--zmq-key``, ``--zmq-allow``, ``--zmq-unauthenticated``) and an HTTPS front (``--ssl-*``).
A bad key file or certificate ends with an error naming its flag, before anything starts."""

from __future__ import annotations

import argparse
import re
from typing import Any

from radixserve.links.keys import load_security
from radixserve.links.tls import ServerTLS


def add_zmq_args(parser: argparse.ArgumentParser, binds: bool = True) -> None:
    """The keys of a process's ZeroMQ sockets (``links/keys.py``); ``binds``: it has server
    sockets (KV events, KV transfer), so it takes an allow-list too."""
    g = parser.add_argument_group("ZeroMQ links (KV events, KV transfer)")
    g.add_argument(
        "--zmq-key",
        metavar="FILE",
        help="this process's CurveZMQ key pair, a .key_secret file from `radixserve keys`; "
        "default: $RADIXSERVE_ZMQ_KEY (the secret key), else ~/.config/radixserve/"
        "zmq.key_secret (made on first use, shared by this user's processes)",
    )
    if binds:
        g.add_argument(
            "--zmq-allow",
            action="append",
            metavar="KEY|FILE|DIR",
            help="also accept clients with this public key (a key, a .key file, or a "
            "directory of them); repeat for several; also $RADIXSERVE_ZMQ_ALLOW "
            "(comma-separated). A client with this process's own key is always accepted",
        )
    g.add_argument(
        "--zmq-unauthenticated",
        action="store_true",
        help="plain ZeroMQ sockets, no keys: anyone who reaches them reads the KV events "
        "(every tenant's cached token ids) and asks for or sends KV",
    )


def zmq_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, used: bool = True
) -> dict[str, Any]:
    """The ``links`` options of ``EngineConfig``; when the sockets will be ``used``, the keys
    are read once now, so that a bad file or key ends with an error naming its flag."""
    options = {
        "zmq_key": args.zmq_key,
        "zmq_allow": tuple(getattr(args, "zmq_allow", None) or ()),
        "zmq_unauthenticated": args.zmq_unauthenticated,
    }
    if used:  # else EngineConfig checks the options alone (config.LinkConfig)
        try:
            load_security(options["zmq_key"], options["zmq_allow"], options["zmq_unauthenticated"])
        except ValueError as e:
            parser.error(zmq_error(e))
    return options


def zmq_error(e: ValueError) -> str:
    """A ``links`` config error in the flags' names."""
    message = re.sub(r"\bzmq_(\w+)", lambda m: "--zmq-" + m.group(1).replace("_", "-"), str(e))
    return f"ZeroMQ keys (--zmq-key, --zmq-allow, $RADIXSERVE_ZMQ_KEY): {message}"


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    """HTTPS on the process's HTTP front (``links/tls.py``)."""
    g = parser.add_argument_group("HTTPS")
    g.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key")
    g.add_argument("--ssl-certfile", metavar="FILE", help="... and this certificate (chain)")
    g.add_argument(
        "--ssl-ca-certs",
        metavar="FILE",
        help="require a client certificate signed by a CA in this file of every caller",
    )


def tls_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerTLS:
    try:
        return ServerTLS(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs)
    except ValueError as e:
        parser.error(str(e))
