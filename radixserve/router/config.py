"""RouterConfig: who may call the router, how it calls its workers, and its limits.

Keys, as on the server (``server/guard.py`` enforces both): any of ``api_keys`` (tenants)
opens the inference endpoints (``/v1/*``, ``/generate``); ``admin_key`` alone opens the
management endpoints (``/workers``, ``/flush_cache``, ``/metrics``), which are closed
whenever keys are configured and it is not. Without any key everything is open.

Workers never see a tenant's key. Every call the router makes to a worker (forwarded
requests, ``/v1/models``, ``/kv_events``, ``/health``, ``/flush_cache``) carries
``worker_api_key``, which should be the workers' ``--admin-key``: with
``salt_from_api_key`` the router names the caller's tenant in ``X-Radixserve-Tenant``, which
a worker honours only from the holder of its admin key.

``first_byte_timeout``: seconds a worker may take to send the first bytes of its answer
(the whole answer, for one that is not streamed); past it the worker counts as hung, leaves
the fleet until a health check passes, and the request is retried on another worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from radixserve.config import parse_bytes
from radixserve.server.config import ServerConfig
from radixserve.server.guard import TENANT_HEADER

ADMIN_PATHS = ("/workers", "/flush_cache", "/metrics")


@dataclass
class RouterConfig:
    api_keys: list[str] = field(default_factory=list)
    admin_key: str | None = None
    worker_api_key: str | None = None
    salt_from_api_key: bool = False
    max_request_bytes: int | str = "4MiB"  # the server's default
    first_byte_timeout: float = 300.0

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
