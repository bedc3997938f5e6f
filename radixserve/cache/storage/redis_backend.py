"""Redis (or Valkey) storage: KV pages as values, one round trip per batch, shared by instances.

Redis key: ``rxkv:<scope tag>:<key hex>``; the scope tag (model name + scope hash) keeps
models and layouts apart on one server, and ``clear`` deletes only that prefix (SCAN +
UNLINK, never FLUSHDB). Value: a page record (``page_format``), checked on every read.

A batch is one pipelined round trip: EXISTS per key for ``exists``, one MGET for ``get``,
SET per key for ``set``; batches of pages are split every ``max_batch_bytes`` (4 MiB): one
64 MiB reply was 1.5-2x slower per page than 4 MiB ones (buffer growth on both sides), while
a loopback round trip costs tens of microseconds.
``set`` writes blindly; a caller that wants to skip present pages asks ``exists`` first.

The store's size is the server's business (``maxmemory`` with an LRU policy); a size given
here is an error, not silently ignored. Failures: every call has a socket timeout and no
client-side retries; a failed call logs a rate-limited warning, returns a short count, and
the backend then answers 0 at once until ``reconnect_interval`` seconds have passed, so a
dead server costs one timeout per interval, never a hang per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from radixserve.cache.storage.base import ClearResult, HostPages, StorageBackend, StorageStats
from radixserve.cache.storage.keys import StorageScope
from radixserve.cache.storage.page_format import PageFormatError, check_page, pack_header

WRITE_CALLS = ("write", "clear", "delete")  # their failures are write errors, the rest reads


class RedisBackend(StorageBackend):
    name = "redis"

    def __init__(
        self,
        scope: StorageScope,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        socket_timeout: float = 2.0,
        connect_timeout: float = 1.0,
        reconnect_interval: float = 2.0,
        max_batch_bytes: int = 4 << 20,
    ):
        super().__init__(scope)
        self.address = f"{host}:{port}/{db}"
        self.prefix = f"rxkv:{scope.tag}:".encode()
        self.reconnect_interval = reconnect_interval
        self._batch_pages = max(1, max_batch_bytes // self.layout.record_nbytes)
        self._client = redis.Redis(
            host=host,
            port=port,
            db=db,
            username=username,
            password=password,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            socket_read_size=1 << 20,  # pages are ~0.4-3 MB: 32 KiB reads halved the speed
            retry=Retry(NoBackoff(), 0),
            client_name="radixserve-kv",
        )
        self._down_until = 0.0
        self._down_lock = threading.Lock()
        self._error = ""  # the last failure, for a clear that has to say why it did not

    # -- the interface --------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes], writing: bool = False) -> int:
        n = 0
        what = "write" if writing else "exists"
        for chunk in self._chunks(keys, len(keys) or 1):  # EXISTS replies are tiny: one trip
            found = self._call(what, lambda c=chunk: self._pipeline("exists", c))
            if found is None:
                break
            lead = next((i for i, f in enumerate(found) if not f), len(found))
            n += lead
            if lead < len(chunk):
                break
        self._count(exists_queries=len(keys), exists_hits=n)
        return n

    def get(self, keys: Sequence[bytes], pages: HostPages) -> int:
        self._check_batch(keys, pages)
        n = nbytes = 0
        for chunk in self._chunks(keys, self._batch_pages):
            names = [self._name(k) for k in chunk]
            values = self._call("read", lambda ns=names: self._client.mget(ns))
            if values is None:
                break
            stop = False
            for key, value in zip(chunk, values, strict=True):
                if value is None:
                    self._count(get_misses=1)
                    stop = True
                    break
                try:
                    payload, window = check_page(self.layout, key, value)
                except PageFormatError as e:
                    self._warn("corrupt", f"refused KV page {self._name(key)!r} in Redis: {e}")
                    self._count(corrupt_pages=1)
                    self._call("delete", lambda k=key: self._client.unlink(self._name(k)))
                    stop = True
                    break
                pages.write_page(n, payload, window)
                nbytes += len(value)
                n += 1
            if stop:
                break
        self._count(pages_read=n, bytes_read=nbytes)
        return n

    def set(self, keys: Sequence[bytes], pages: HostPages) -> int:
        self._check_batch(keys, pages)
        n = nbytes = 0
        for chunk in self._chunks(keys, self._batch_pages):
            records = []
            for j, key in enumerate(chunk):
                payload, window = pages.read_page(n + j), pages.has_window(n + j)
                header = pack_header(self.layout, key, payload, window)
                records.append(b"".join((header, payload)))
            replies = self._call("write", lambda c=chunk, r=records: self._set_all(c, r))
            if replies is None:
                break
            lead = next((i for i, ok in enumerate(replies) if ok is not True), len(replies))
            nbytes += sum(len(r) for r in records[:lead])
            n += lead
            if lead < len(chunk):  # e.g. the server is out of memory with no eviction policy
                self._warn("refused", f"Redis at {self.address} refused a KV page: {replies[lead]}")
                self._count(write_errors=1)
                break
        self._count(pages_written=n, bytes_written=nbytes)
        return n

    def clear(self) -> ClearResult:
        def scan_and_unlink() -> bool:
            batch = []
            for name in self._client.scan_iter(match=self.prefix + b"*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)
            return True

        if self._call("clear", scan_and_unlink, honour_backoff=False):
            return ClearResult(True)
        return ClearResult(False, f"Redis KV store at {self.address} failed: {self._error}")

    def stats(self) -> StorageStats:
        return self._snapshot()

    def close(self) -> None:
        self._client.close()

    # -- helpers --------------------------------------------------------------------------

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    @staticmethod
    def _chunks(keys: Sequence[bytes], size: int):
        for start in range(0, len(keys), size):
            yield keys[start : start + size]

    def _pipeline(self, command: str, keys: Sequence[bytes]) -> list:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            getattr(pipe, command)(self._name(key))
        return pipe.execute()

    def _set_all(self, keys: Sequence[bytes], records: list[bytes]) -> list:
        pipe = self._client.pipeline(transaction=False)
        for key, record in zip(keys, records, strict=True):
            pipe.set(self._name(key), record)
        return pipe.execute(raise_on_error=False)

    def _call(self, what: str, fn, honour_backoff: bool = True):
        """Run one round trip; on failure warn, back off, and return None. Every failure
        counts, a call refused at once while backing off too."""
        kind = "write_errors" if what in WRITE_CALLS else "read_errors"
        if honour_backoff and time.monotonic() < self._down_until:
            self._count(**{kind: 1})
            return None
        try:
            result = fn()
        except (redis.RedisError, OSError) as e:
            self._error = str(e)
            with self._down_lock:
                self._down_until = time.monotonic() + self.reconnect_interval
            self._warn(
                "unavailable",
                f"Redis KV store at {self.address} failed ({what}: {e}); retrying in "
                f"{self.reconnect_interval:g}s, computing instead meanwhile",
            )
            self._count(**{kind: 1})
            return None
        return result
