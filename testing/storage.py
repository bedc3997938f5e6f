"""Shared pieces of the storage-tier tests: small layouts, random pages, keys, mounts."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import tempfile

import torch

from radixserve.cache.storage import PageLayout, StorageScope, TensorPages, chain_page_keys

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
SCOPE = StorageScope("tiny-llama-test", LAYOUT)
# a model with sliding-window layers 0, 1 and 3 (global: 2): a page may be stored without them
WINDOW_LAYOUT = PageLayout(4, 2, 8, 4, "float32", window_layers=(0, 1, 3))
WINDOW_SCOPE = StorageScope("tiny-gemma-test", WINDOW_LAYOUT)


def random_pages(n: int, layout: PageLayout = LAYOUT, seed: int = 0,
                 windows: list[bool] | None = None) -> TensorPages:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    data = torch.randn((n, *layout.page_shape), generator=g).to(layout.torch_dtype)
    return TensorPages(data.contiguous(), layout.window_layers, windows)


def check_window_round_trip(backend) -> None:
    """Pages with and without window KV (a tombstone's copy) come back from ``backend`` (of
    ``WINDOW_SCOPE``) with their flag: every layer bit for bit, or the global layer only."""
    windows = [True, False, False, True, False]
    keys, src = keys_for(5, WINDOW_SCOPE), random_pages(5, WINDOW_LAYOUT, windows=windows)
    assert backend.set(keys, src) == 5
    dst = TensorPages.empty(WINDOW_LAYOUT, 5)
    assert dst.windows == [True] * 5
    assert backend.get(keys, dst) == 5
    assert dst.windows == windows
    for i, window in enumerate(windows):
        layers = [0, 1, 2, 3] if window else [2]
        assert torch.equal(dst.tensor[i, layers], src.tensor[i, layers])
        if not window:  # the window layers were not stored: nothing came back for them
            assert not dst.tensor[i, [0, 1, 3]].any()
    full, tombstone = (WINDOW_LAYOUT.payload_nbytes(w) for w in (True, False))
    assert tombstone * 4 == full  # one layer of four
    stats = backend.stats()
    assert (
        stats.bytes_written
        == stats.bytes_read
        == sum(WINDOW_LAYOUT.record_nbytes - full + (full if w else tombstone) for w in windows)
    )


def keys_for(n: int, scope: StorageScope = SCOPE, first_token: int = 100) -> list[bytes]:
    tokens = list(range(first_token, first_token + n * scope.layout.page_size))
    return chain_page_keys(scope, None, tokens)


@functools.cache
def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN): tried, not guessed."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as d:
        try:
            with tmpfs(d, "64k"):
                return os.path.ismount(d)
        except (OSError, subprocess.CalledProcessError):
            return False


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A real, small tmpfs at ``path`` (root only); unmounted afterwards, even on failure."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def remount_read_only(path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def remount_read_write(path) -> None:
    subprocess.run(["mount", "-o", "remount,rw", str(path)], check=True, capture_output=True)
