"""The storage tier (L3): KV pages kept in a file directory or a Redis server, by chained key.

``open_backend(url, scope, capacity_bytes)`` turns the ``--kv-storage`` option into a
backend: ``file:///absolute/path`` or ``redis://[user:password@]host[:port][/db]``. See
``base`` for the contract every backend keeps, ``keys`` for how pages are named and
``page_format`` for what a stored page looks like.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from radixserve.cache.storage.base import (
    ClearResult,
    HostPages,
    RateLimitedWarning,
    StorageBackend,
    StorageStats,
    TensorPages,
)
from radixserve.cache.storage.file_backend import FileBackend
from radixserve.cache.storage.keys import StorageScope, chain_page_keys
from radixserve.cache.storage.page_format import PageFormatError, PageLayout

__all__ = [
    "ClearResult",
    "FileBackend",
    "HostPages",
    "PageFormatError",
    "PageLayout",
    "RateLimitedWarning",
    "StorageBackend",
    "StorageScope",
    "StorageStats",
    "TensorPages",
    "chain_page_keys",
    "open_backend",
]


def open_backend(
    url: str, scope: StorageScope, capacity_bytes: int | None = None
) -> StorageBackend:
    """A backend for ``--kv-storage URL``; a ValueError naming the option for a bad URL."""
    parts = urlsplit(url)
    if capacity_bytes is not None and capacity_bytes <= 0:
        raise ValueError(f"--kv-storage-size must be positive, got {capacity_bytes} bytes")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"--kv-storage {url!r}: write file:///absolute/path (three slashes)")
        if parts.query or parts.fragment:
            raise ValueError(f"--kv-storage {url!r}: file storage takes no options")
        return FileBackend(unquote(parts.path), scope, capacity_bytes)
    if parts.scheme == "redis":
        return _open_redis(url, parts, scope, capacity_bytes)
    raise ValueError(
        f"--kv-storage {url!r}: unsupported storage; use file:///absolute/path or "
        "redis://host:port/db"
    )


def _open_redis(url, parts, scope: StorageScope, capacity_bytes: int | None) -> StorageBackend:
    if capacity_bytes is not None:
        raise ValueError(
            "--kv-storage-size applies to file storage; a Redis store is sized by the "
            "server's maxmemory (with maxmemory-policy allkeys-lru)"
        )
    if not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"--kv-storage {url!r}: write redis://host:port/db (no options)")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"--kv-storage {url!r}: the port is not a number") from None
    db_text = parts.path.strip("/") or "0"
    if not db_text.isdigit():
        raise ValueError(f"--kv-storage {url!r}: the database must be a number, got {db_text!r}")
    from radixserve.cache.storage.redis_backend import RedisBackend  # the client, only if used

    return RedisBackend(
        scope,
        host=parts.hostname,
        port=port,
        db=int(db_text),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )
