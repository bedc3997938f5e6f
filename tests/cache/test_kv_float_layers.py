"""An int8 pool that keeps some layers in the model's dtype (``KVShape.float_layers``).

The float layers live in a pool of their own and are written and read as plain values; the
int8 layers are unchanged. Rows that leave the device pool (host pages, stored pages, the
transfer wire: ``KVPool.layer_rows``) are int8 for every layer, so a float layer comes back
as its int8 encoding decodes, and the int8 layers bit for bit; the byte counts follow from
the format of each layer.
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
MIXED = FLOAT.with_format(INT8, (1,))
PAGE = 4


def filled(shape: KVShape, slots: int, seed: int = 0) -> tuple[KVPool, list]:
    """A pool whose every slot holds random K/V (keys with one large channel); the values."""
    torch.manual_seed(seed)
    pool = KVPool(shape, slots)
    written = []
    for layer in range(shape.num_layers):
        k = torch.randn(slots, shape.num_kv_heads, shape.head_dim)
        k[..., 5] += 30
        v = torch.randn_like(k)
        pool.write(layer, torch.arange(slots), k, v)
        written.append((k, v))
    return pool, written


def test_float_layers_keep_their_values_and_their_bytes():
    pool, written = filled(MIXED, 16)
    assert pool.layer_format(1) == KVFormat("float32") and pool.layer_format(0) == INT8
    assert pool.fk.shape == (1, 2, 17, 32) and pool.k.shape == (2, 2, 17, INT8.row_bytes(32))
    k, v = pool.gather(1, torch.arange(16))
    assert torch.equal(k, written[1][0].transpose(0, 1)) and torch.equal(
        v, written[1][1].transpose(0, 1)
    )
    k0, _ = pool.gather(0, torch.arange(16))
    assert not torch.equal(k0, written[0][0].transpose(0, 1))  # int8 layers are rounded
    per_token = 2 * 2 * (2 * INT8.row_bytes(32) + 32 * 4)
    assert MIXED.bytes_per_token() == per_token and pool.nbytes() == 16 * per_token
    assert MIXED.format_name == "int8g16+float32@1"


def test_float_layers_are_checked():
    with pytest.raises(ValueError, match="layers 0..2"):
        FLOAT.with_format(INT8, (3,))
    with pytest.raises(ValueError, match="int8 pool"):
        KVShape(3, 2, 32, torch.float32, float_layers=(0,))


def test_mixed_pages_through_the_host_and_storage(tmp_path):
    pool, _ = filled(MIXED, 64, seed=1)
    host = HostKVPool(pool, 32, PAGE)
    assert host.page_nbytes == 3 * 2 * 2 * PAGE * INT8.row_bytes(32)  # int8 for every layer
    src, dst = torch.arange(8, 24), torch.arange(40, 56)
    slots = host.alloc(16)
    host.backup(src, slots)
    # through a storage backend and into other host pages, bit for bit
    layout = PageLayout.from_shape(MIXED.with_format(INT8), PAGE)
    assert layout.page_nbytes == host.page_nbytes
    scope = StorageScope("m", layout)
    backend = open_backend(f"file://{tmp_path}", scope)
    keys = keys_for(4, scope)
    assert backend.set(keys, host.pages(host.pages_of(slots).tolist())) == 4
    back = TensorPages.empty(layout, 4)
    assert backend.get(keys, back) == 4
    again = host.alloc(16)
    host.data[host.pages_of(again)] = back.tensor.view(host.data.dtype).view_as(host.data[:4])
    host.restore(again, dst)
    assert torch.equal(pool.k[:, :, dst], pool.k[:, :, src])  # int8 layers: bit for bit
    values, returned = pool.fk[:, :, src], pool.fk[:, :, dst]
    assert torch.equal(returned, INT8.decode(INT8.encode(values), 32, torch.float32))
    assert torch.equal(pool.fv[:, :, dst], INT8.decode(INT8.encode(pool.fv[:, :, src]), 32,
                                                       torch.float32))  # fmt: skip
    host.free(torch.cat([slots, again]))
    host.check(torch.empty(0, dtype=torch.int64))  # every page back: nothing leaked
