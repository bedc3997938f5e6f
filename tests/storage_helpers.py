"""Shared pieces of the storage-tier tests: a small layout, random pages, keys, mounts."""

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


def random_pages(n: int, layout: PageLayout = LAYOUT, seed: int = 0) -> TensorPages:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn((n, *layout.page_shape), generator=g).to(layout.torch_dtype)
    return TensorPages(data.contiguous())


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
