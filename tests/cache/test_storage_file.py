"""The file storage backend against a real directory (and real tmpfs mounts where allowed)."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import torch

from radixserve.cache.storage import (
    FileBackend,
    PageLayout,
    StorageScope,
    TensorPages,
    open_backend,
)
from radixserve.cache.storage import file_backend as file_module
from testing.storage import (
    LAYOUT,
    SCOPE,
    WINDOW_LAYOUT,
    WINDOW_SCOPE,
    can_mount,
    check_window_round_trip,
    keys_for,
    random_pages,
    remount_read_only,
    tmpfs,
)

RECORD = LAYOUT.record_nbytes


def page_files(backend: FileBackend) -> set[str]:
    return {p.stem for p in backend.dir.glob("*/*.kv")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    layout = PageLayout(3, 2, 16, 8, dtype)
    scope = StorageScope("m", layout)
    keys = keys_for(5, scope)
    src = random_pages(5, layout)
    backend = open_backend(f"file://{tmp_path}", scope)
    assert backend.set(keys, src) == 5
    dst = TensorPages.empty(layout, 5)
    assert backend.get(keys, dst) == 5
    assert torch.equal(dst.tensor.view(torch.uint8), src.tensor.view(torch.uint8))
    s = backend.stats()
    assert (s.pages_written, s.pages_read, s.stored_pages) == (5, 5, 5)
    assert s.used_bytes == 5 * layout.record_nbytes


def test_exists_and_get_count_leading_pages_only(tmp_path):
    keys = keys_for(4)
    src = random_pages(4)
    backend = FileBackend(tmp_path, SCOPE)
    assert backend.exists(keys) == 0
    # store pages 0, 1 and 3: page 2 is a gap, so page 3 is unreachable
    assert backend.set(keys[:2], src) == 2
    assert backend.set(keys[3:], TensorPages(src.tensor[3:])) == 1
    assert backend.exists(keys) == 2
    dst = TensorPages.empty(LAYOUT, 4)
    assert backend.get(keys, dst) == 2
    assert torch.equal(dst.tensor[:2], src.tensor[:2])
    assert backend.stats().get_misses == 1


def test_set_counts_present_pages_and_skips_rewriting_them(tmp_path):
    keys = keys_for(3)
    backend = FileBackend(tmp_path, SCOPE)
    assert backend.set(keys[:2], random_pages(2)) == 2
    assert backend.set(keys, random_pages(3)) == 3
    assert backend.stats().pages_written == 3  # the two present pages were not rewritten


def test_size_cap_deletes_least_recently_used(tmp_path):
    keys = keys_for(4)
    src = random_pages(4)
    backend = FileBackend(tmp_path, SCOPE, capacity_bytes=3 * RECORD)
    assert backend.set(keys[:3], src) == 3
    # read page 0: page 1 becomes the least recently used
    assert backend.get(keys[:1], TensorPages.empty(LAYOUT, 1)) == 1
    assert backend.set(keys[3:], TensorPages(src.tensor[3:])) == 1
    assert page_files(backend) == {keys[i].hex() for i in (0, 2, 3)}
    s = backend.stats()
    assert s.evicted_pages == 1 and s.used_bytes == 3 * RECORD <= s.capacity_bytes


def test_cap_smaller_than_one_page_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--kv-storage-size"):
        FileBackend(tmp_path, SCOPE, capacity_bytes=RECORD - 1)


def test_restart_finds_pages_and_their_recency(tmp_path):
    keys = keys_for(4)
    src = random_pages(4)
    FileBackend(tmp_path, SCOPE).set(keys, src)
    # recency as a previous run left it: page 2 oldest, then 0, 3, 1
    for age, i in enumerate((1, 3, 0, 2)):
        os.utime(FileBackend(tmp_path, SCOPE)._path(keys[i].hex()), (1e9 - age, 1e9 - age))
    restarted = FileBackend(tmp_path, SCOPE)
    assert restarted.exists(keys) == 4 and restarted.stats().stored_pages == 4
    dst = TensorPages.empty(LAYOUT, 4)
    assert restarted.get(keys, dst) == 4
    assert torch.equal(dst.tensor, src.tensor)
    # a restart with a smaller cap keeps the two most recently used pages
    for age, i in enumerate((1, 3, 0, 2)):
        os.utime(restarted._path(keys[i].hex()), (1e9 - age, 1e9 - age))
    smaller = FileBackend(tmp_path, SCOPE, capacity_bytes=2 * RECORD)
    assert page_files(smaller) == {keys[1].hex(), keys[3].hex()}


def test_pages_with_and_without_window_kv_round_trip_with_their_flag(tmp_path):
    check_window_round_trip(FileBackend(tmp_path, WINDOW_SCOPE))
    sizes = sorted(p.stat().st_size for p in FileBackend(tmp_path, WINDOW_SCOPE).dir.rglob("*.kv"))
    small = WINDOW_LAYOUT.record_nbytes - WINDOW_LAYOUT.payload_nbytes(True) // 4 * 3
    assert sizes == [small] * 3 + [WINDOW_LAYOUT.record_nbytes] * 2  # a tombstone's: 1 layer
    restarted = FileBackend(tmp_path, WINDOW_SCOPE)  # both sizes are pages, found again
    assert restarted.stats().stored_pages == 5 and restarted.stats().corrupt_pages == 0
    dst = TensorPages.empty(WINDOW_LAYOUT, 5)
    assert restarted.get(keys_for(5, WINDOW_SCOPE), dst) == 5
    assert dst.windows == [True, False, False, True, False]


def test_reads_refresh_recency_on_disk(tmp_path):
    keys = keys_for(1)
    backend = FileBackend(tmp_path, SCOPE)
    backend.set(keys, random_pages(1))
    path = backend._path(keys[0].hex())
    os.utime(path, (1e9, 1e9))
    backend.get(keys, TensorPages.empty(LAYOUT, 1))
    assert path.stat().st_mtime > 1e9 + 1


def test_start_up_scan_removes_stale_temporaries_and_torn_pages(tmp_path):
    keys = keys_for(2)
    backend = FileBackend(tmp_path, SCOPE)
    backend.set(keys, random_pages(2))
    torn = backend._path(keys[1].hex())
    torn.write_bytes(torn.read_bytes()[:100])
    stale = torn.with_name(".dead.1.2.tmp")
    fresh = torn.with_name(".live.1.2.tmp")
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (1e9, 1e9))
    restarted = FileBackend(tmp_path, SCOPE)
    assert not torn.exists() and not stale.exists() and fresh.exists()
    assert restarted.exists(keys) == 1 and restarted.stats().corrupt_pages == 1


def test_clear_deletes_only_this_scope(tmp_path):
    other = StorageScope("another-model", LAYOUT)
    mine, theirs = FileBackend(tmp_path, SCOPE), FileBackend(tmp_path, other)
    mine.set(keys_for(2), random_pages(2))
    theirs.set(keys_for(2, other), random_pages(2))
    assert mine.clear().cleared
    assert mine.exists(keys_for(2)) == 0 and page_files(mine) == set()
    assert mine.stats().used_bytes == 0
    assert theirs.exists(keys_for(2, other)) == 2


def test_corrupt_and_truncated_pages_are_refused_counted_and_deleted(tmp_path, caplog):
    keys = keys_for(3)
    backend = FileBackend(tmp_path, SCOPE)
    backend.set(keys, random_pages(3))
    flipped = backend._path(keys[1].hex())
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0x01
    flipped.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert backend.get(keys, TensorPages.empty(LAYOUT, 3)) == 1
    assert "checksum" in caplog.text and not flipped.exists()
    truncated = backend._path(keys[0].hex())
    truncated.write_bytes(truncated.read_bytes()[:-1])
    assert backend.get(keys, TensorPages.empty(LAYOUT, 3)) == 0
    assert not truncated.exists()
    assert backend.stats().corrupt_pages == 2 and backend.exists(keys) == 0


def test_a_page_renamed_to_another_key_is_refused(tmp_path):
    keys = keys_for(2)
    backend = FileBackend(tmp_path, SCOPE)
    backend.set(keys[:1], random_pages(1))
    os.makedirs(backend._path(keys[1].hex()).parent, exist_ok=True)
    backend._path(keys[0].hex()).rename(backend._path(keys[1].hex()))
    assert backend.get(keys[1:], TensorPages.empty(LAYOUT, 1)) == 0
    assert backend.stats().corrupt_pages == 1


def test_injected_disk_full_gives_a_warning_and_a_short_count(tmp_path, monkeypatch, caplog):
    keys = keys_for(4)
    backend = FileBackend(tmp_path, SCOPE)
    real_write, calls = file_module._write_all, []

    def write_until_full(f, data):
        calls.append(1)
        if len(calls) > 4:  # header + payload of two pages, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(f, data)

    monkeypatch.setattr(file_module, "_write_all", write_until_full)
    with caplog.at_level(logging.WARNING):
        assert backend.set(keys, random_pages(4)) == 2
    assert "disk full" in caplog.text
    assert backend.stats().write_errors == 1
    assert not list(backend.dir.glob("*/*.tmp"))  # the partial temporary was removed
    assert backend.exists(keys) == 2


@pytest.mark.skipif(not can_mount(), reason="needs root with the right to mount a tmpfs")
def test_real_full_disk(tmp_path, caplog):
    layout = PageLayout(4, 4, 64, 16, "float32")  # 64 KiB pages on a 512 KiB disk
    scope = StorageScope("m", layout)
    keys = keys_for(12, scope)
    src = random_pages(12, layout)
    with tmpfs(tmp_path / "disk", "512k") as disk:
        backend = FileBackend(disk, scope)
        with caplog.at_level(logging.WARNING):
            stored = backend.set(keys, src)
        assert 0 < stored < 12
        assert "No space left on device" in caplog.text
        dst = TensorPages.empty(layout, 12)
        assert backend.get(keys, dst) == stored
        assert torch.equal(dst.tensor[:stored], src.tensor[:stored])


def test_read_only_directory_serves_pages_and_refuses_writes(tmp_path, caplog, monkeypatch):
    keys = keys_for(3)
    src = random_pages(3)
    root = tmp_path / "ro"
    with tmpfs(root, "1m") if can_mount() else _plain_dir(root):
        FileBackend(root, SCOPE).set(keys[:2], src)
        if can_mount():
            remount_read_only(root)  # a real read-only file system (root ignores chmod)
        elif os.geteuid() != 0:
            os.chmod(root, 0o555)
            for d in root.rglob("*"):
                if d.is_dir():
                    os.chmod(d, 0o555)
        else:  # root without mount rights: inject the error a read-only mount gives
            monkeypatch.setattr(os, "replace", _raise(errno.EROFS))
        backend = FileBackend(root, SCOPE)
        dst = TensorPages.empty(LAYOUT, 3)
        assert backend.get(keys, dst) == 2
        assert torch.equal(dst.tensor[:2], src.tensor[:2])
        with caplog.at_level(logging.WARNING):
            assert backend.set(keys, src) == 2  # the third page cannot be written
        assert "write failed" in caplog.text and backend.stats().write_errors == 1


@pytest.mark.skipif(not can_mount(), reason="needs root with the right to mount a tmpfs")
def test_clear_on_a_read_only_directory_says_so_and_keeps_counting_its_pages(tmp_path):
    keys = keys_for(3)
    with tmpfs(tmp_path / "ro", "1m") as root:
        backend = FileBackend(root, SCOPE)
        assert backend.set(keys, random_pages(3)) == 3
        remount_read_only(root)  # a real read-only file system (root ignores chmod)
        result = backend.clear()
        assert not result.cleared and "Read-only file system" in result.reason
        assert backend.stats().stored_pages == 3 and len(page_files(backend)) == 3
        assert backend.exists(keys) == 3 and backend.stats().write_errors == 1


def test_unusable_directory_warns_and_stores_nothing(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        backend = open_backend(f"file://{blocker}/kv", SCOPE)
        assert backend.set(keys_for(1), random_pages(1)) == 0
    assert "unusable" in caplog.text
    assert backend.exists(keys_for(1)) == 0


def test_another_instance_sharing_the_directory_sees_new_pages(tmp_path):
    a, b = FileBackend(tmp_path, SCOPE), FileBackend(tmp_path, SCOPE)
    keys = keys_for(2)
    a.set(keys, random_pages(2))
    assert b.exists(keys) == 2 and b.stats().stored_pages == 2


def test_one_reader_and_one_writer_concurrently(tmp_path):
    n = 48
    keys = keys_for(n)
    src = random_pages(n)
    backend = FileBackend(tmp_path, SCOPE, capacity_bytes=24 * RECORD)
    errors: list[str] = []

    def writer():
        for i in range(0, n, 4):
            if backend.set(keys[i : i + 4], TensorPages(src.tensor[i : i + 4])) != 4:
                errors.append(f"short write at {i}")

    def reader():
        dst = TensorPages.empty(LAYOUT, n)
        for _ in range(40):
            got = backend.get(keys, dst)
            if not torch.equal(dst.tensor[:got], src.tensor[:got]):
                errors.append("a read returned bytes of another page")

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    s = backend.stats()
    assert s.used_bytes <= 24 * RECORD and s.corrupt_pages == 0
    assert len(page_files(backend)) == s.stored_pages


def test_a_read_that_missed_a_page_written_meanwhile_leaves_it_indexed(tmp_path, monkeypatch):
    """A reader misses a page, then the writer stores and indexes it before the reader unindexes
    its miss: the index keeps the page (it used to drop it while its file stayed)."""
    backend = FileBackend(tmp_path, SCOPE)
    keys, src = keys_for(1), random_pages(1)

    def miss_then_lose_the_race(path, view):
        backend.set(keys, src)  # the writer, between the reader's miss and its bookkeeping
        raise FileNotFoundError(path)

    monkeypatch.setattr(backend, "_read", miss_then_lose_the_race)
    assert backend.get(keys, TensorPages.empty(LAYOUT, 1)) == 0
    monkeypatch.undo()
    assert len(page_files(backend)) == backend.stats().stored_pages == 1
    assert backend.exists(keys) == 1


def test_a_batch_that_does_not_match_the_layout_is_a_caller_error(tmp_path):
    backend = FileBackend(tmp_path, SCOPE)
    with pytest.raises(ValueError, match="host pages"):
        backend.get(keys_for(3), TensorPages.empty(LAYOUT, 2))
    other = PageLayout(2, 2, 8, 8, "float32")
    with pytest.raises(ValueError, match="layout"):
        backend.set(keys_for(1), TensorPages.empty(other, 1))


def _plain_dir(path):
    import contextlib

    path.mkdir()
    return contextlib.nullcontext(path)


def _raise(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail
