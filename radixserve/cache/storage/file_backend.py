"""File storage: one file per KV page under a directory, LRU-capped, found again on restart.

Layout: ``<root>/<scope tag>/<first 2 hex digits of the key>/<key hex>.kv``. The scope tag
(model name + scope hash) keeps models and layouts apart in one root; the 256-way fan-out
keeps directories small. A page is written to a temporary name in the same directory and
renamed into place, so a reader (or a second instance sharing the directory) sees a whole
file or none. There is no fsync: a page lost or torn by a crash fails its size or checksum
check on read and is deleted, which is all a cache needs.

The size cap counts this scope's page files. Recency lives in memory (an ordered dict,
oldest first) and is seeded on start-up from the files' mtimes, which ``get`` refreshes, so a
restarted server keeps both its pages (warm restart) and their LRU order. Temporary files
older than a minute are leftovers of a crash and are removed by the start-up scan.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from radixserve.cache.storage.base import ClearResult, HostPages, StorageBackend, StorageStats
from radixserve.cache.storage.keys import StorageScope
from radixserve.cache.storage.page_format import PageFormatError, check_page, pack_header

SUFFIX = ".kv"
STALE_TMP_SECONDS = 60.0


class FileBackend(StorageBackend):
    name = "file"

    def __init__(self, root: str | Path, scope: StorageScope, capacity_bytes: int | None = None):
        super().__init__(scope)
        record = self.layout.record_nbytes
        if capacity_bytes is not None and capacity_bytes < record:
            raise ValueError(
                f"--kv-storage-size {capacity_bytes} bytes is smaller than one page "
                f"({record} bytes for {self.layout.descriptor})"
            )
        self.root = Path(root)
        self.dir = self.root / scope.tag
        self._dirname = str(self.dir)
        self.capacity_bytes = capacity_bytes
        self._record = record  # the largest record; a page without window KV is smaller
        self._sizes = self.layout.record_sizes
        self._lru: OrderedDict[str, int] = OrderedDict()  # key hex -> file size, oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._scan()

    # -- start-up -------------------------------------------------------------------------

    def _scan(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._warn("mkdir", f"KV storage directory {self.dir} is unusable ({e}): pages "
                       "will not be stored")  # fmt: skip
            return
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for sub in _scandir(self.dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in _scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        _unlink(entry.path)
                elif entry.name.endswith(SUFFIX) and entry.name[:2] == sub.name:
                    if st.st_size in self._sizes:
                        found.append((st.st_mtime, entry.name[: -len(SUFFIX)], st.st_size))
                    else:  # torn by a crash, or another layout: never readable
                        _unlink(entry.path)
                        self._count(corrupt_pages=1)
        found.sort()
        with self._lock:
            for _, hexkey, size in found:
                self._lru[hexkey] = size
                self._used += size
            self._evict_over_cap()

    # -- the interface --------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes], writing: bool = False) -> int:
        n = 0
        for key in keys:
            hexkey = key.hex()
            with self._lock:
                known = hexkey in self._lru
            if not known and not self._adopt(hexkey):  # written by an instance sharing the dir?
                break
            n += 1
        self._count(exists_queries=len(keys), exists_hits=n)
        return n

    def get(self, keys: Sequence[bytes], pages: HostPages) -> int:
        self._check_batch(keys, pages)
        buf = bytearray(self._record)
        view = memoryview(buf)
        n = nbytes = 0
        for key in keys:
            hexkey = key.hex()
            path = self._path(hexkey)
            try:
                got = self._read(path, view)
                payload, window = check_page(self.layout, key, view[:got])
            except FileNotFoundError:
                self._forget(hexkey)
                self._count(get_misses=1)
                break
            except PageFormatError as e:
                self._warn("corrupt", f"refused KV page file {path}: {e}; deleted it")
                _unlink(path)
                self._forget(hexkey)
                self._count(corrupt_pages=1)
                break
            except OSError as e:
                self._warn("read", f"could not read KV page file {path}: {e}")
                self._count(read_errors=1)
                break
            pages.write_page(n, payload, window)
            nbytes += got
            with self._lock:
                known = hexkey in self._lru
                if known:
                    self._lru.move_to_end(hexkey)
            if not known:
                self._adopt(hexkey)
            n += 1
        self._count(pages_read=n, bytes_read=nbytes)
        return n

    def set(self, keys: Sequence[bytes], pages: HostPages) -> int:
        self._check_batch(keys, pages)
        n = written = nbytes = 0
        for key in keys:
            hexkey = key.hex()
            with self._lock:
                present = hexkey in self._lru
            if not present:
                size = self._write(key, hexkey, pages.read_page(n), pages.has_window(n))
                if not size:
                    break
                written += 1
                nbytes += size
                self._adopt(hexkey)  # (unless a concurrent clear() has deleted it already)
            n += 1
        self._count(pages_written=written, bytes_written=nbytes)
        return n

    def clear(self) -> ClearResult:
        """Delete every page file; a file that cannot be deleted stays indexed (and counted)."""
        failed: list[OSError] = []
        with self._lock:
            try:
                subs = list(os.scandir(self.dir))
            except FileNotFoundError:
                subs = []
            except OSError as e:
                failed.append(e)
                subs = []
            for sub in subs:
                if sub.is_dir(follow_symlinks=False):
                    for entry in _scandir(sub.path):
                        if entry.name.endswith(SUFFIX):
                            self._delete(entry, failed)
            if not failed:
                self._lru.clear()
                self._used = 0
        if not failed:
            return ClearResult(True)
        self._count(write_errors=1)
        reason = f"{len(failed)} KV page file(s) in {self.dir} could not be deleted: {failed[0]}"
        self._warn("clear", reason)
        return ClearResult(False, reason)

    def _delete(self, entry: os.DirEntry, failed: list[OSError]) -> None:
        """Unlink one page file and forget it, or note why not (the caller holds the lock)."""
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append(e)
            return
        size = self._lru.pop(entry.name[: -len(SUFFIX)], None)
        if size is not None:
            self._used -= size

    def stats(self) -> StorageStats:
        with self._lock:
            used, pages = self._used, len(self._lru)
        return self._snapshot(capacity_bytes=self.capacity_bytes, used_bytes=used,
                              stored_pages=pages)  # fmt: skip

    # -- helpers --------------------------------------------------------------------------

    def _path(self, hexkey: str) -> Path:
        return Path(self._dirname, hexkey[:2], hexkey + SUFFIX)

    def _read(self, path: Path, view: memoryview) -> int:
        """Read a whole page file into ``view`` (room for the largest record); returns its
        size (its contents are checked by the caller)."""
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size not in self._sizes:
                raise PageFormatError(
                    f"file of {size} bytes, a page record is one of {sorted(self._sizes)}"
                )
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            try:
                os.utime(f.fileno())  # recency that survives a restart (LRU seed)
            except OSError:
                pass  # a read-only store still serves pages
        return got

    def _write(self, key: bytes, hexkey: str, payload, window: bool) -> int:
        """Store one page; its record's size, or 0 when it failed."""
        path = self._path(hexkey)
        tmp = path.with_name(f".{hexkey}.{os.getpid()}.{threading.get_ident()}.tmp")
        header = pack_header(self.layout, key, payload, window)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb", buffering=0) as f:
                _write_all(f, header)
                _write_all(f, payload)
            os.replace(tmp, path)
            return len(header) + memoryview(payload).nbytes
        except OSError as e:
            _unlink(tmp)
            kind = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "write failed"
            self._warn(kind, f"KV page not stored in {self.dir} ({kind}: {e})")
            self._count(write_errors=1)
            return 0

    def _adopt(self, hexkey: str) -> bool:
        """Index a page file that is on disk now (and evict past the cap); False if none.

        The index changes only under the lock and only after checking the disk there, and
        eviction deletes under the same lock, so the index never names a deleted file for
        long: a reader's page can be evicted mid-read, never resurrected in the index.
        """
        with self._lock:
            if hexkey in self._lru:
                return True
            try:
                size = self._path(hexkey).stat().st_size
            except OSError:
                return False
            if size not in self._sizes:
                return False
            self._lru[hexkey] = size
            self._used += size
            self._evict_over_cap()
        return True

    def _forget(self, hexkey: str) -> None:
        """Unindex a page found missing (or just deleted), unless its file is there again: a
        writer may have stored and indexed it between the failed read and this call."""
        with self._lock:
            if self._path(hexkey).exists():
                return
            size = self._lru.pop(hexkey, None)
            if size is not None:
                self._used -= size

    def _evict_over_cap(self) -> None:
        """Delete the oldest pages until under the cap (the caller holds the lock)."""
        evicted = 0
        while self.capacity_bytes is not None and self._used > self.capacity_bytes:
            hexkey, size = self._lru.popitem(last=False)
            self._used -= size
            _unlink(self._path(hexkey))
            evicted += 1
        if evicted:
            self._count(evicted_pages=evicted)


def _write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view) :]


def _scandir(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
