"""ServerConfig: every option of the HTTP front end in one validated dataclass.

Limits keep one client from taking the server down: the body size is checked before the
body is read, the sequences of one request (prompts x ``n``) and the queue of sequences
waiting for the engine are bounded (beyond the queue: 503 with ``Retry-After``), and so are
the responses each tenant's ``/v1/responses`` keeps for ``previous_response_id``. Keys: any
of ``api_keys`` opens the API; ``admin_key`` alone opens the cache tools (``/flush_cache``,
``/clear_kv_storage``, ``/cache``, ``/debug/*``) and ``/kv_events``, which are closed whenever
keys are configured and it is not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import parse_bytes

TENANT_HEADER = "x-radixserve-tenant"  # a router's caller, trusted from the admin key only
SAMPLING_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "max_tokens",
)


@dataclass
class ServerConfig:
    served_model_name: str | None = None
    api_keys: list[str] = field(default_factory=list)
    admin_key: str | None = None
    salt_from_api_key: bool = False  # every key its own cache namespace
    # decode instance: prefill endpoints any caller may name in X-Radixserve-Prefill (the
    # engine's own --prefill-endpoint too); the admin key may name any
    trusted_prefill: list[str] = field(default_factory=list)
    debug_cache_text: bool = False  # /cache shows prefix text (else counts and hashes)
    max_request_bytes: int | str = "4MiB"
    max_request_sequences: int = 64  # prompts x n in one request
    max_queued_requests: int = 256  # sequences waiting beyond the running batch
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for running requests
    engine_restarts: int = 3  # restarts of a dead engine within ten minutes, then exit
    default_sampling: dict[str, Any] = field(default_factory=dict)  # overrides the model's
    stored_responses: int = 1024  # per tenant, for the Responses API's previous_response_id

    def __post_init__(self) -> None:
        self.max_request_bytes = parse_bytes(self.max_request_bytes)
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1KiB")
        for name in (
            "max_request_sequences",
            "max_queued_requests",
            "engine_restarts",
            "stored_responses",
        ):
            value = getattr(self, name)
            low = 1 if name == "max_request_sequences" else 0
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout!r}")
        if any(not k for k in self.api_keys) or self.admin_key == "":
            raise ValueError("API keys must not be empty")
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise ValueError("the admin key must differ from every API key")
        for endpoint in self.trusted_prefill:
            if not endpoint.startswith("tcp://"):
                got = endpoint
                raise ValueError(f"trusted_prefill must look like tcp://HOST:PORT, got {got!r}")
        if self.salt_from_api_key and not self.api_keys:
            raise ValueError("salt_from_api_key needs at least one API key")
        unknown = sorted(set(self.default_sampling) - set(SAMPLING_DEFAULT_KEYS))
        if unknown:
            raise ValueError(
                f"default_sampling: unknown parameter(s) {', '.join(unknown)}; "
                f"valid: {', '.join(SAMPLING_DEFAULT_KEYS)}"
            )

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys or self.admin_key)

    @classmethod
    def from_options(cls, **options: Any) -> ServerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown server option(s) {', '.join(unknown)}")
        return cls(**options)


def parse_sampling_overrides(text: str) -> dict[str, Any]:
    """``"temperature=0.2,top_p=0.9"`` -> ``{"temperature": 0.2, "top_p": 0.9}``."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not value.strip():
            raise ValueError(f"expected NAME=VALUE, got {item!r}")
        if key not in SAMPLING_DEFAULT_KEYS:
            raise ValueError(
                f"unknown parameter {key!r}; valid: {', '.join(SAMPLING_DEFAULT_KEYS)}"
            )
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{key}: {value.strip()!r} is not a number") from None
        out[key] = int(number) if key in ("top_k", "max_tokens") and number.is_integer() else number
    return out
