"""int8 keys stored in a channel order with power-of-two scales (``KeyOrder``, part of the
``KVFormat``).

Scores of the stored rows against queries in the stored order (times the scales) are the
scores of the same rounded values in the model's order and scale, exactly. Wherever keys
come back as values (the pool's ``gather``, an int8 pool's float layers and window layers,
a float device pool's int8 host pages) they are in the model's order; int8 rows move between
tiers and through storage bit for bit, and a stored page names its order (pages of another
order, or of none, are another layout); the transfer wire names it too.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.cache import KVPool, KVShape
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.kv_format import KeyOrder, KVFormat
from radixserve.cache.storage import PageLayout, StorageScope, TensorPages, open_backend
from radixserve.cache.window_pages import WindowedAllocator
from testing.storage import keys_for

PLAIN = KVFormat.of("int8")
LAYERS, HEADS, DIM = 3, 2, 32


def random_order(seed: int = 0) -> KeyOrder:
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(DIM, generator=g) for _ in range(LAYERS * HEADS)]
    scale = torch.exp2(torch.randint(0, 4, (LAYERS, HEADS, DIM), generator=g).float())
    return KeyOrder(torch.stack(perms).view(LAYERS, HEADS, DIM), scale)


ORDER = random_order()
ORDERED = PLAIN.with_key_order(ORDER)
FLOAT = KVShape(LAYERS, HEADS, DIM, torch.float32, key_order=ORDER)


def keys(n: int, seed: int = 0) -> torch.Tensor:
    """[n, heads, dim] keys with a large channel in each head, as Qwen2's key biases make."""
    torch.manual_seed(seed)
    k = torch.randn(n, HEADS, DIM)
    k[..., 3] += 40
    return k


def test_scores_of_the_ordered_rows_are_those_of_the_same_values_in_the_models_order():
    k = keys(50).transpose(0, 1).double()  # [heads, n, dim]
    q = torch.randn(7, 4 * HEADS, DIM, dtype=torch.float64)  # 4 query heads per KV head
    rows = ORDERED.encode(k, keys_of=1)
    as_stored = PLAIN.decode(rows, DIM, torch.float64)  # the rows' values, in the stored order
    as_model = ORDERED.decode(rows, DIM, torch.float64, keys_of=1)
    assert torch.equal(ORDER.to_model(as_stored, 1), as_model)
    assert torch.equal(ORDER.to_stored(as_model, 1), as_stored)
    stored_q = ORDERED.stored_queries(q, 1)
    scores = torch.einsum("thd,hnd->thn", stored_q, as_stored.repeat_interleave(4, 0))
    want = torch.einsum("thd,hnd->thn", q, as_model.repeat_interleave(4, 0))
    torch.testing.assert_close(scores, want, rtol=1e-12, atol=1e-12)
    # queries are rounded in the stored groups (the kernels'), handed back in the model's order
    rounded = ORDERED.round_queries(q, 1)
    assert torch.equal(ORDER.queries(rounded, 1), PLAIN.round_queries(stored_q))
    assert not torch.equal(rounded, PLAIN.round_queries(q))


def test_an_order_is_a_permutation_with_power_of_two_scales():
    with pytest.raises(ValueError, match="permutation"):
        KeyOrder(torch.zeros(1, 1, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="powers of two"):
        KeyOrder(torch.arange(16).view(1, 1, 16), torch.full((1, 1, 16), 3.0))
    assert ORDER == random_order() and ORDER != random_order(1) and ORDERED != PLAIN


def test_an_order_by_size_rounds_the_small_channels_finer():
    k = keys(64, seed=1).transpose(0, 1)  # channel 3 large in every head
    k[:, :, 3 + DIM // 2] += 30  # and its rotary partner
    size = torch.zeros(LAYERS, HEADS, DIM // 2)
    size[:, :, 3] = 50
    order = KeyOrder(KeyOrder.by_pair_size(size))
    assert order.perm[0, 0, :2].tolist() == [3, 3 + DIM // 2]
    fmt = PLAIN.with_key_order(order)
    apart = order.perm[0, 0, 16:]  # the second stored group: small pairs only
    err = [(f.decode(f.encode(k, keys_of=0), DIM, torch.float32, keys_of=0) - k)[0][:, apart].norm()
           for f in (fmt, PLAIN)]  # fmt: skip
    assert err[0] < 0.2 * err[1], err


def test_the_pool_reads_keys_back_in_the_models_order():
    """int8 layers, a float layer (its rows int8 on the way out, values on the way in) and
    window layers kept apart: each gives back the keys written, in the model's order."""
    k, v = keys(16), keys(16, seed=5)
    mixed = KVPool(FLOAT.with_format(ORDERED, (1,)), 16)
    for layer in range(LAYERS):
        mixed.write(layer, torch.arange(16), k, v)
    want = ORDERED.decode(ORDERED.encode(k.transpose(0, 1), keys_of=0), DIM, torch.float32,
                          keys_of=0)  # fmt: skip
    assert torch.equal(mixed.gather(0, torch.arange(16))[0], want)
    assert not torch.equal(want, PLAIN.decode(PLAIN.encode(k.transpose(0, 1)), DIM, torch.float32))
    # (random scales round coarsely; in the wrong order the keys would be far off)
    close = lambda a, b: float((a - b).norm() / b.norm()) < 0.2  # noqa: E731
    assert close(want, k.transpose(0, 1))
    # the float layer's keys as rows (stored order) and back: its rounded values, model order
    rows = mixed.layer_rows(0, 0, LAYERS, torch.arange(8))
    assert torch.equal(rows[1], ORDERED.encode(k[:8].transpose(0, 1), keys_of=1))
    mixed.put_layer_rows(0, 0, LAYERS, torch.arange(8, 16), rows)
    back = mixed.gather(1, torch.arange(8, 16))[0]
    assert torch.equal(back, ORDERED.decode(rows[1], DIM, torch.float32, keys_of=1))
    assert close(back, k[:8].transpose(0, 1))
    # window layers in a pool of their own
    windowed = KVShape(LAYERS, HEADS, DIM, torch.float32, (0, 2), ORDERED, key_order=ORDER)
    alloc = WindowedAllocator(16, 4, window_slots=16, window=5)
    pool = KVPool(windowed, alloc.num_slots, window_map=alloc.window_map, window_slots=16)
    slots = alloc.alloc(8)
    for layer in range(LAYERS):
        pool.write(layer, slots, k[:8], v[:8])
        want = ORDERED.decode(ORDERED.encode(k[:8].transpose(0, 1), keys_of=layer), DIM,
                              torch.float32, keys_of=layer)  # fmt: skip
        assert torch.equal(pool.gather(layer, slots)[0], want), layer


def test_float_device_pages_encoded_in_the_order_and_back(tmp_path):
    pool = KVPool(FLOAT, 32)
    for layer in range(LAYERS):
        pool.write(layer, torch.arange(32), keys(32, layer), keys(32, layer + 9))
    fmt = FLOAT.int8_format
    assert fmt == ORDERED and fmt.name == f"int8g16k{ORDER.digest}"
    host = HostKVPool(pool, 32, 4, fmt)
    slots = host.alloc(16)
    host.backup(torch.arange(16), slots)
    pages = host.data[host.pages_of(slots)]  # [n, layers, 2, heads, page, row]
    rows = pages[:, :, 0].permute(1, 2, 0, 3, 4).reshape(LAYERS, HEADS, 16, -1)
    assert torch.equal(rows, ORDERED.encode(pool.k[:, :, :16], keys_of=slice(None)))
    host.restore(slots, torch.arange(16, 32))
    want = ORDERED.decode(rows, DIM, torch.float32, keys_of=slice(None))
    assert torch.equal(pool.k[:, :, 16:32], want)
    assert torch.equal(pool.v[:, :, 16:32], PLAIN.decode(PLAIN.encode(pool.v[:, :, :16]), DIM,
                                                         torch.float32))  # fmt: skip


def test_ordered_pages_through_the_host_and_storage_bit_for_bit(tmp_path):
    shape = FLOAT.with_format(ORDERED)
    pool = KVPool(shape, 32)
    for layer in range(LAYERS):
        pool.write(layer, torch.arange(32), keys(32, layer), keys(32, layer + 9))
    host = HostKVPool(pool, 32, 4)
    slots = host.alloc(16)
    host.backup(torch.arange(16), slots)
    layout = PageLayout.from_shape(shape, 4)
    assert layout.dtype == ORDERED.name and layout.format.row_bytes(DIM) == PLAIN.row_bytes(DIM)
    others = (
        PageLayout.from_shape(FLOAT.with_format(PLAIN), 4),
        PageLayout.from_shape(FLOAT.with_format(PLAIN.with_key_order(random_order(1))), 4),
    )
    assert all(o.layout_id != layout.layout_id for o in others)  # pages never mix
    scope = StorageScope("m", layout)
    backend = open_backend(f"file://{tmp_path}", scope)
    keys_ = keys_for(4, scope)
    assert backend.set(keys_, host.pages(host.pages_of(slots).tolist())) == 4
    back = TensorPages.empty(layout, 4)
    assert backend.get(keys_, back) == 4
    again = host.alloc(16)
    host.data[host.pages_of(again)] = back.tensor.view(host.data.dtype).view_as(host.data[:4])
    host.restore(again, torch.arange(16, 32))
    assert torch.equal(pool.k[:, :, 16:32], pool.k[:, :, :16])
    assert torch.equal(pool.gather(2, torch.arange(16, 32))[0], pool.gather(2, torch.arange(16))[0])
