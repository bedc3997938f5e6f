"""TLS for the HTTP links: the server's and the router's HTTPS front, and the router's
checks of HTTPS workers.

``ServerTLS`` is what an HTTPS front is given (``--ssl-keyfile``, ``--ssl-certfile``, and with
``--ssl-ca-certs`` a client certificate signed by that CA is required of every caller); its
``uvicorn_options`` go to uvicorn. ``ClientTLS`` is how the router checks workers it reaches
over ``https://``: their certificates against the system's trust store or ``ca_certs``
(``--worker-ca-certs``), and, for workers that require one, the router's own client
certificate (``--worker-cert``, ``--worker-key``). Both check their files when built, so a
missing or unreadable file is an error naming its option, not a failure at the first call.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any


def _check_file(option: str, path: str | None) -> None:
    if path is None:
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"{option}: cannot read {path}: {e.strerror}") from e


@dataclass(frozen=True)
class ServerTLS:
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # set: callers must present a certificate it signed

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs (client certificates) needs --ssl-certfile")
        for option, path in (("--ssl-keyfile", self.ssl_keyfile),
                             ("--ssl-certfile", self.ssl_certfile),
                             ("--ssl-ca-certs", self.ssl_ca_certs)):  # fmt: skip
            _check_file(option, path)
        if self.ssl_certfile is not None:
            self.context()  # a key that does not fit the certificate fails here, not later

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs:
                ctx.load_verify_locations(self.ssl_ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-certfile / --ssl-keyfile / --ssl-ca-certs: {e}") from e
        return ctx

    def uvicorn_options(self) -> dict[str, Any]:
        if self.ssl_certfile is None:
            return {}
        return {
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if self.ssl_ca_certs else ssl.CERT_NONE,
        }


@dataclass(frozen=True)
class ClientTLS:
    ca_certs: str | None = None  # None: the system's trust store
    certfile: str | None = None  # the client certificate, for workers that require one
    keyfile: str | None = None

    def __post_init__(self) -> None:
        if self.keyfile is not None and self.certfile is None:
            raise ValueError("--worker-key needs --worker-cert")
        for option, path in (("--worker-ca-certs", self.ca_certs),
                             ("--worker-cert", self.certfile),
                             ("--worker-key", self.keyfile)):  # fmt: skip
            _check_file(option, path)
        self.context()

    def context(self) -> ssl.SSLContext:
        """Certificates and host names are always checked; there is no option to skip it."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_certs)
            if self.certfile:
                ctx.load_cert_chain(self.certfile, self.keyfile)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--worker-ca-certs / --worker-cert / --worker-key: {e}") from e
        return ctx
