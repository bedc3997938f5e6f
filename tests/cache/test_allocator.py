import pytest
import torch

from radixserve.cache import KVPool, KVShape, PagedAllocator


def test_alloc_and_free_page_size_1():
    a = PagedAllocator(8)
    x = a.alloc(5)
    assert x.dtype == torch.int64 and len(set(x.tolist())) == 5
    assert a.free_size() == 3
    assert a.alloc(4) is None and a.free_size() == 3  # nothing taken on failure
    a.free(x)
    assert a.free_size() == 8
    a.check(held_indices=torch.empty(0, dtype=torch.int64))


def test_pages_are_whole_and_contiguous():
    a = PagedAllocator(64, page_size=16)
    x = a.alloc(20)  # two pages, 20 slots used
    assert len(x) == 20 and a.num_free_pages() == 2
    assert x[0] % 16 == 0 and x[16] % 16 == 0
    assert (x[:16].diff() == 1).all() and (x[16:].diff() == 1).all()
    a.check(held_indices=x)
    a.free(x)
    assert a.num_free_pages() == 4


def test_alloc_extend_fills_the_partial_page_first():
    a = PagedAllocator(64, page_size=16)
    x = a.alloc(5)
    y = a.alloc_extend(int(x[-1]), 13)
    assert y[:11].tolist() == list(range(int(x[-1]) + 1, int(x[-1]) + 12))
    assert y[11] % 16 == 0 and a.num_free_pages() == 2
    assert a.alloc_extend(int(x[-1]), 200) is None and a.num_free_pages() == 2
    a.check(held_indices=torch.cat([x, y]))


def test_alloc_decode_opens_a_page_only_at_a_page_end():
    a = PagedAllocator(64, page_size=4)
    x = a.alloc(4)
    y = a.alloc(2)
    out = a.alloc_decode(torch.tensor([int(x[-1]), int(y[-1])]))
    assert out[0] % 4 == 0 and out[0] // 4 not in (x[0] // 4, y[0] // 4)
    assert out[1] == y[-1] + 1
    assert a.num_free_pages() == 16 - 3


def test_double_free_raises():
    a = PagedAllocator(8, page_size=2)
    x = a.alloc(4)
    a.free(x)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x[:2])
    b = PagedAllocator(8)
    y = b.alloc(2)
    with pytest.raises(RuntimeError, match="double free"):
        b.free(torch.cat([y, y[:1]]))


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="page_size"):
        PagedAllocator(8, page_size=0)
    with pytest.raises(ValueError, match="negative"):
        PagedAllocator(8).alloc(-1)


def test_kv_pool_write_and_memory_sizing():
    shape = KVShape(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32)
    assert shape.bytes_per_token() == 2 * 2 * 3 * 4 * 4
    assert shape.slots_for_memory(shape.bytes_per_token() * 100 + 5, page_size=16) == 96
    pool = KVPool(shape, num_slots=10)
    k = torch.randn(3, 3, 4)
    v = torch.randn(3, 3, 4)
    slots = torch.tensor([7, 2, 5])
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k[1][:, slots].transpose(0, 1), k)
    assert torch.equal(pool.v[1][:, slots].transpose(0, 1), v)
    gk, gv = pool.gather(1, slots)
    assert torch.equal(gk.transpose(0, 1), k) and torch.equal(gv.transpose(0, 1), v)
    assert pool.k[:, :, pool.pad_slot].abs().sum() == 0 and pool.k[0].shape == (3, 11, 4)
    assert pool.nbytes() == 10 * shape.bytes_per_token()
    with pytest.raises(ValueError, match="positive"):
        shape.slots_for_memory(0)
