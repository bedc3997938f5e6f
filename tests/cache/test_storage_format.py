"""Storage keys, the stored page format, and the --kv-storage URL."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from radixserve.cache.kv_pool import KVShape
from radixserve.cache.storage import (
    PageFormatError,
    PageLayout,
    StorageScope,
    chain_page_keys,
    open_backend,
)
from radixserve.cache.storage.page_format import check_page, pack_header
from testing.storage import LAYOUT, SCOPE, WINDOW_LAYOUT, WINDOW_SCOPE, keys_for, random_pages

TOKENS = list(range(1000, 1016))  # four pages of four tokens


def test_a_key_names_the_whole_prefix():
    keys = chain_page_keys(SCOPE, None, TOKENS)
    assert len(keys) == 4 and len(set(keys)) == 4
    # chaining from the previous page's key gives the same names as one call
    assert chain_page_keys(SCOPE, keys[1], TOKENS[8:]) == keys[2:]
    # a shorter sequence has the leading keys; a partial page has no key
    assert chain_page_keys(SCOPE, None, TOKENS[:10]) == keys[:2]
    # changing one token of page 0 renames every page after it
    changed = chain_page_keys(SCOPE, None, [7, *TOKENS[1:]])
    assert not set(changed) & set(keys)
    # list, int32 and int64 arrays name the same tokens the same way
    assert chain_page_keys(SCOPE, None, np.array(TOKENS, dtype=np.int64)) == keys


def test_keys_are_stable_across_processes_and_releases():
    # A change here orphans every page already stored: give the format a new version instead.
    scope = StorageScope("SmolLM2-135M-Instruct", PageLayout(30, 3, 64, 16, "float32"))
    key = chain_page_keys(scope, None, list(range(16)))[0]
    assert key.hex() == "27dd645029fc299239965c194b4d616d"


def test_models_layouts_and_namespaces_never_share_keys():
    base = set(chain_page_keys(SCOPE, None, TOKENS))
    others = [
        chain_page_keys(StorageScope("another-model", LAYOUT), None, TOKENS),
        chain_page_keys(
            StorageScope(SCOPE.model_id, PageLayout(2, 2, 8, 4, "bfloat16")), None, TOKENS
        ),
        chain_page_keys(
            StorageScope(SCOPE.model_id, PageLayout(3, 2, 8, 4, "float32")), None, TOKENS
        ),
        chain_page_keys(SCOPE, None, TOKENS, namespace="tenant-a"),
        chain_page_keys(SCOPE, None, TOKENS, namespace="tenant-b"),
    ]
    for keys in others:
        assert len(keys) == 4 and not base & set(keys)
    assert not set(others[-1]) & set(others[-2])


def test_layout_from_the_kv_pool_shape():
    import torch

    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    layout = PageLayout.from_shape(shape, page_size=16)
    assert layout == PageLayout(30, 3, 64, 16, "bfloat16")
    assert layout.page_nbytes == 16 * shape.bytes_per_token()
    with pytest.raises(ValueError, match="dtype"):
        PageLayout(30, 3, 64, 16, "int8")
    with pytest.raises(ValueError, match="page_size"):
        PageLayout(30, 3, 64, 0, "float32")


def _record(key: bytes) -> bytearray:
    payload = random_pages(1).read_page(0)
    return bytearray(pack_header(LAYOUT, key, payload) + bytes(payload))


def test_check_page_accepts_exactly_the_page_asked_for():
    key = keys_for(1)[0]
    record = _record(key)
    payload, window = check_page(LAYOUT, key, record)
    assert bytes(payload) == bytes(random_pages(1).read_page(0)) and window
    assert len(record) == 48 + LAYOUT.page_nbytes == LAYOUT.record_nbytes


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda r: r[:30], "truncated"),
        (lambda r: r[:-1], "wrong size"),
        (lambda r: r + b"\0", "wrong size"),
        (lambda r: b"XXXX" + r[4:], "magic"),
        (lambda r: r[:4] + b"\x09\x00" + r[6:], "version"),
        (lambda r: r[:8] + b"\1" * 8 + r[16:], "layout"),
        (lambda r: r[:16] + b"\2" * 16 + r[32:], "another key"),
        (lambda r: r[:-1] + bytes([r[-1] ^ 0x80]), "checksum"),
    ],
)
def test_check_page_refuses_damaged_or_foreign_records(damage, reason):
    key = keys_for(1)[0]
    with pytest.raises(PageFormatError, match=reason):
        check_page(LAYOUT, key, bytes(damage(_record(key))))


def test_page_of_another_layout_is_refused():
    other = PageLayout(2, 2, 8, 4, "bfloat16")
    key = keys_for(1)[0]
    with pytest.raises(PageFormatError, match="layout"):
        check_page(other, key, bytes(_record(key)))


def test_pages_without_window_layers_keep_the_first_format():
    """A layout without window layers writes version 1 pages (no flag, every layer), byte for
    byte what was stored before version 2 existed, so such stores keep their pages; a
    layout with window layers writes version 2 and refuses version 1, whose payload its
    header size would misplace, and the reverse."""
    key = keys_for(1)[0]
    payload = bytes(random_pages(1).read_page(0))
    first = struct.pack("<4sHH8s16sQQ", b"RXKV", 1, 48, LAYOUT.layout_id, key, len(payload),
                        xxhash.xxh3_64_intdigest(payload))  # fmt: skip
    assert pack_header(LAYOUT, key, payload) == first
    stored, window = check_page(LAYOUT, key, first + payload)
    assert bytes(stored) == payload and window
    assert (LAYOUT.format_version, WINDOW_LAYOUT.format_version) == (1, 2)
    window_key = keys_for(1, WINDOW_SCOPE)[0]
    full = bytes(random_pages(1, WINDOW_LAYOUT).read_page(0))
    second = pack_header(WINDOW_LAYOUT, window_key, full)
    assert len(second) == 56
    old = struct.pack("<4sHH8s16sQQ", b"RXKV", 1, 48, WINDOW_LAYOUT.layout_id, window_key,
                      len(full), xxhash.xxh3_64_intdigest(full))  # fmt: skip
    with pytest.raises(PageFormatError, match="version 1"):
        check_page(WINDOW_LAYOUT, window_key, old + full)
    with pytest.raises(PageFormatError, match="version 2"):
        check_page(LAYOUT, key, second + full)


def test_window_flag_is_checked_against_the_layout_and_the_size():
    key = keys_for(1, WINDOW_SCOPE)[0]
    pages = random_pages(2, WINDOW_LAYOUT, windows=[True, False])
    full, tombstone = (bytes(pages.read_page(i)) for i in range(2))
    assert len(tombstone) == WINDOW_LAYOUT.payload_nbytes(False) == len(full) // 4
    record = pack_header(WINDOW_LAYOUT, key, tombstone, window=False) + tombstone
    payload, window = check_page(WINDOW_LAYOUT, key, record)
    assert bytes(payload) == tombstone and not window
    flipped = bytearray(record)
    flipped[48] ^= 1  # says "every layer" over a payload of the global layer only
    with pytest.raises(PageFormatError, match="wrong size"):
        check_page(WINDOW_LAYOUT, key, bytes(flipped))
    # a page of the same model whose layout names other window layers is another layout
    other = PageLayout(4, 2, 8, 4, "float32", window_layers=(0, 1, 2))
    with pytest.raises(PageFormatError, match="layout"):
        check_page(other, key, record)
    assert other.descriptor != WINDOW_LAYOUT.descriptor != LAYOUT.descriptor
    # a layout without window layers has no page without them (and no flag to say so)
    with pytest.raises(ValueError, match="without window layers"):
        pack_header(LAYOUT, key, bytes(LAYOUT.payload_nbytes(True) // 2), window=False)
    unknown = bytearray(record)
    unknown[48] |= 2  # a flag bit no version defines
    with pytest.raises(PageFormatError, match="flags"):
        check_page(WINDOW_LAYOUT, key, bytes(unknown))


def test_window_layers_must_be_layers():
    with pytest.raises(ValueError, match="window_layers"):
        PageLayout(4, 2, 8, 4, "float32", window_layers=(1, 0))
    with pytest.raises(ValueError, match="window_layers"):
        PageLayout(4, 2, 8, 4, "float32", window_layers=(4,))


@pytest.mark.parametrize(
    "url, match",
    [
        ("s3://bucket/kv", "unsupported storage"),
        ("/tmp/kv", "unsupported storage"),
        ("file://relative/kv", "three slashes"),
        ("file:///tmp/kv?size=1", "no options"),
        ("redis://", "redis://host:port/db"),
        ("redis://127.0.0.1:6379/zero", "must be a number"),
        ("redis://127.0.0.1:port/0", "port"),
        ("redis://127.0.0.1:6379/0?timeout=1", "no options"),
    ],
)
def test_bad_storage_urls_name_the_option(url, match):
    with pytest.raises(ValueError, match=match) as err:
        open_backend(url, SCOPE)
    assert "--kv-storage" in str(err.value)


def test_storage_size_is_refused_for_redis_and_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="--kv-storage-size.*maxmemory"):
        open_backend("redis://127.0.0.1:6379/0", SCOPE, capacity_bytes=1 << 30)
    with pytest.raises(ValueError, match="--kv-storage-size must be positive"):
        open_backend(f"file://{tmp_path}", SCOPE, capacity_bytes=0)
