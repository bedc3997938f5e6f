"""KV formats through the tiers: the host pool and stored pages keep rows in their format.

An int8 device pool's rows (codes and scales) go to host pages and back bit for bit, and
through a storage backend bit for bit; a float device pool with int8 host pages
(``kv_tier_dtype int8``) stores each row as ``KVFormat.encode`` makes it and gets back what
those codes decode to (within half a quantization step of the values); the page layout of
int8 rows says so in its descriptor (so float and int8 pages never mix) and its size.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.cache import KVPool, KVShape
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.kv_format import KVFormat
from radixserve.cache.storage import PageLayout, StorageScope, TensorPages, open_backend
from testing.storage import keys_for

INT8 = KVFormat.of("int8")
FLOAT = KVShape(num_layers=3, num_kv_heads=2, head_dim=32, dtype=torch.float32)
PAGE = 4


def filled(shape: KVShape, slots: int, seed: int = 0) -> KVPool:
    """A pool whose every slot holds random K/V (keys with one large channel, as Qwen2's)."""
    torch.manual_seed(seed)
    pool = KVPool(shape, slots)
    for layer in range(shape.num_layers):
        k = torch.randn(slots, shape.num_kv_heads, shape.head_dim)
        k[..., 5] += 30
        pool.write(layer, torch.arange(slots), k, torch.randn_like(k))
    return pool


def test_int8_device_pages_round_trip_through_the_host_bit_for_bit():
    pool = filled(FLOAT.with_format(INT8), 64)
    assert pool.k.dtype == torch.uint8 and pool.k.shape[-1] == INT8.row_bytes(32)
    host = HostKVPool(pool, 32, PAGE)
    assert host.format == INT8 and host.page_nbytes == 3 * 2 * 2 * PAGE * INT8.row_bytes(32)
    src, dst = torch.arange(8, 24), torch.arange(40, 56)
    host_slots = host.alloc(16)
    host.backup(src, host_slots)
    host.restore(host_slots, dst)
    assert torch.equal(pool.k[:, :, dst], pool.k[:, :, src])
    assert torch.equal(pool.v[:, :, dst], pool.v[:, :, src])


def test_float_device_pool_with_int8_host_pages():
    """Pages are encoded as they leave a float pool (3.6x the tokens per host byte) and come
    back as what their codes say: within half a step of the values, the same on every trip."""
    pool = filled(FLOAT, 64, seed=1)
    host = HostKVPool(pool, 32, PAGE, INT8)
    plain = HostKVPool(pool, 32, PAGE)
    assert plain.page_nbytes / host.page_nbytes > 3.5
    src, dst = torch.arange(0, 16), torch.arange(32, 48)
    slots = host.alloc(16)
    host.backup(src, slots)
    # the host rows are exactly the encoding of the device's values
    pages = host.data[host.pages_of(slots)]  # [n, layers, 2, heads, page, row]
    rows = pages[:, :, 0].permute(1, 2, 0, 3, 4).reshape(3, 2, 16, -1)
    assert torch.equal(rows, INT8.encode(pool.k[:, :, src]))
    host.restore(slots, dst)
    values, back = pool.k[:, :, src], pool.k[:, :, dst]
    step = values.view(3, 2, 16, 2, 16).abs().amax(-1, keepdim=True) / 127
    assert ((back - values).view(3, 2, 16, 2, 16).abs() <= step * 0.51).all()
    assert not torch.equal(back, values)  # (it was rounded)
    # a second trip of the rounded values is exact: their encoding is the same codes
    host.backup(dst, slots)
    host.restore(slots, src)
    assert torch.equal(pool.k[:, :, src], back) and torch.equal(
        pool.v[:, :, src], pool.v[:, :, dst]
    )


def test_a_host_tier_cannot_hold_another_float_format():
    with pytest.raises(ValueError, match="only int8 pages below a float pool"):
        HostKVPool(KVPool(FLOAT, 16), 16, PAGE, KVFormat("float16"))


def test_int8_pages_through_storage_bit_for_bit(tmp_path):
    pool = filled(FLOAT.with_format(INT8), 32, seed=2)
    host = HostKVPool(pool, 32, PAGE)
    slots = host.alloc(16)
    host.backup(torch.arange(16), slots)
    layout = PageLayout.from_shape(pool.shape, PAGE)
    assert layout.dtype == "int8g16" and layout.descriptor.endswith(":int8g16")
    assert layout.page_nbytes == host.page_nbytes
    assert layout.layout_id != PageLayout.from_shape(FLOAT, PAGE).layout_id
    scope = StorageScope("m", layout)
    backend = open_backend(f"file://{tmp_path}", scope)
    keys = keys_for(4, scope)
    assert backend.set(keys, host.pages(host.pages_of(slots).tolist())) == 4
    back = TensorPages.empty(layout, 4)
    assert back.tensor.dtype == torch.uint8
    assert backend.get(keys, back) == 4
    assert torch.equal(back.tensor, host.data[host.pages_of(slots)])
