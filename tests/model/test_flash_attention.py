"""The native attention kernel (csrc/flash_attention.cpp) and the KV formats it reads.

Against a float64 reference on the same stored KV: every format (float32, bfloat16, float16,
int8 rows), decode rows, prompt chunks after a prefix, sparse rows, window ranges, long
contexts split across threads and merged; ``paged_attention``'s native and PyTorch paths on
one packed step; int8 rows encoded the same by the kernels and by ``KVFormat``.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.cache import KVPool, KVShape
from radixserve.cache.kv_format import KeyOrder, KVFormat
from radixserve.model import attention, build_forward_batch, native
from radixserve.model.forward_batch import SparsePrefill

FORMATS = {
    "float32": KVFormat("float32"),
    "bfloat16": KVFormat("bfloat16"),
    "float16": KVFormat("float16"),
    "int8": KVFormat("int8", 16),
}


@pytest.fixture(scope="module")
def ops():
    kernels = native.paged_ops()
    if kernels is None:
        pytest.skip("the native kernels did not build on this machine")
    return kernels


def reference(q, k, v, ctx, ctx_start, seq_start, lo, hi, scale, fmt=None) -> torch.Tensor:
    """Each row's softmax over its range, in float64, K and V ``[KVH, slots, D]`` floats; one
    masked product per context (a row with an empty range gets zeros). Against int8 keys
    (``fmt``) the queries are rounded as the kernel rounds them."""
    if fmt is not None:
        q = fmt.round_queries(q * scale) / scale
    group = q.shape[1] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(len(ctx_start)):
        r0, r1 = int(seq_start[s]), int(seq_start[s + 1])
        if r0 == r1:
            continue
        n = int(hi[r0:r1].max())
        keys = ctx[int(ctx_start[s]) : int(ctx_start[s]) + n]
        j = torch.arange(n)
        inside = (j >= lo[r0:r1, None]) & (j < hi[r0:r1, None])  # [rows, n]
        scores = torch.einsum("rhd,hnd->hrn", q[r0:r1].double(), k[:, keys]) * scale
        probs = scores.masked_fill(~inside, float("-inf")).softmax(-1).nan_to_num(0.0)
        out[r0:r1] = torch.einsum("hrn,hnd->rhd", probs, v[:, keys])
    return out.float()


def stored(fmt: KVFormat, heads: int, slots: int, dim: int):
    """Random K/V as stored in ``fmt`` and as the floats they decode to. Keys get one very
    large channel, as Qwen2's key biases give them."""
    k, v = torch.randn(heads, slots, dim) * 2, torch.randn(heads, slots, dim)
    k[:, :, 3] += 40
    k_rows, v_rows = fmt.encode(k).contiguous(), fmt.encode(v).contiguous()
    return (
        k_rows,
        v_rows,
        fmt.decode(k_rows, dim, torch.float32),
        fmt.decode(v_rows, dim, torch.float32),
    )


def problem(slots: int, contexts: list[tuple[int, int, int]]):
    """Rows over random contexts: per context (length, rows at its end, window; 0: none)."""
    ctx, ctx_start, seq_start, lo, hi = [], [], [0], [], []
    for length, rows, window in contexts:
        ctx_start.append(len(ctx))
        ctx += torch.randperm(slots)[:length].tolist()
        for i in range(rows):
            end = length - rows + i + 1
            hi.append(end)
            lo.append(max(0, end - window) if window else 0)
        seq_start.append(seq_start[-1] + rows)
    return [torch.tensor(x, dtype=torch.int64) for x in (ctx, ctx_start, seq_start, lo, hi)]


@pytest.mark.parametrize("name", sorted(FORMATS))
# 7 and 8 query heads per KV head: a decode row in a micro tile of 6 and one of the rest
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 14, 2), (128, 12, 2), (32, 4, 4), (64, 16, 2)])
def test_kernel_matches_the_reference_in_every_format(ops, name, dim, heads, kv_heads):
    torch.manual_seed(0)
    fmt = FORMATS[name]
    k, v, kf, vf = stored(fmt, kv_heads, 1500, dim)
    # a decode row, a long decode row, a chunk after a prefix, a whole prompt, a window
    args = problem(1500, [(1, 1, 0), (1300, 1, 0), (300, 37, 0), (130, 130, 0), (700, 9, 100)])
    q = torch.randn(len(args[3]), heads, dim)
    out = ops.flash_attention(q, k, v, fmt.kernel_code, fmt.group, *args, 0.125)
    torch.testing.assert_close(out, reference(q, kf, vf, *args, 0.125, fmt), rtol=1e-4, atol=1e-4)


def test_long_context_split_across_threads_matches(ops):
    """One decode row over 20K keys: its range is split into parts (their own max and sum),
    merged after; sparse rows (any hi) and a row with nothing to read (zeros)."""
    torch.manual_seed(1)
    fmt = FORMATS["int8"]
    k, v, kf, vf = stored(fmt, 1, 20000, 64)
    ctx, ctx_start, seq_start, lo, hi = problem(20000, [(20000, 1, 0), (5000, 3, 0)])
    hi[1:] = torch.tensor([17, 2500, 4999])  # sparse rows of the second context
    lo[2] = hi[2]  # an empty range
    args = (ctx, ctx_start, seq_start, lo, hi)
    q = torch.randn(4, 7, 64) * 3
    out = ops.flash_attention(q, k, v, fmt.kernel_code, fmt.group, *args, 0.125)
    torch.testing.assert_close(out, reference(q, kf, vf, *args, 0.125, fmt), rtol=1e-4, atol=1e-4)
    assert out[2].abs().max() == 0


def test_int8_rows_encode_alike_and_decode_within_half_a_step(ops):
    torch.manual_seed(2)
    x = torch.randn(500, 128) * torch.logspace(-3, 3, 500)[:, None]
    x[0] = 0
    x[1, :16] = 0  # a zero group: scale 0, codes 0
    fmt = FORMATS["int8"]
    rows = fmt.encode(x)
    assert rows.shape == (500, 128 + 2 * 8) and rows.dtype == torch.uint8
    assert torch.equal(ops.encode_kv_i8(x, 16), rows)
    back = fmt.decode(rows, 128, torch.float32)
    step = x.view(500, 8, 16).abs().amax(-1, keepdim=True) / 127
    assert ((back - x).view(500, 8, 16).abs() <= step * 0.51 + 1e-30).all()
    assert fmt.row_bytes(64) == 72 and 4 * 64 / fmt.row_bytes(64) > 3.5  # bytes vs float32


@pytest.mark.parametrize("name", ["float32", "int8", "int8-ordered"])
def test_paged_attention_native_and_pytorch_paths_agree(ops, name, monkeypatch):
    """One packed step (decode rows, a chunk after a prefix, a sparse prefill, a first chunk),
    through the pool in its format: the native kernel and the PyTorch path agree (with a key
    order: the kernel takes the queries in the stored order, the PyTorch path the keys back
    in the model's order; and the order changes the result, so it is applied)."""
    torch.manual_seed(3)
    fmt = FORMATS[name.removesuffix("-ordered")]
    if name.endswith("-ordered"):
        perm = torch.stack([torch.randperm(64) for _ in range(2)])[None]  # [layers, heads, dim]
        fmt = fmt.with_key_order(KeyOrder(perm))
    shape = KVShape(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                    kv_format=fmt)  # fmt: skip
    pool = KVPool(shape, 3000)
    for t in (pool.k, pool.v):
        t.copy_(shape.kv_format.encode(torch.randn(1, 2, 3001, 64)))
    perm = torch.randperm(3000)
    decode = [(5, 99, perm[:100]), (6, 999, perm[100:1100])]
    sparse = SparsePrefill(torch.arange(5), torch.tensor([3, 50, 51, 300, 399]), perm[1100:1500])
    prefill = [(torch.arange(40), 200, perm[1500:1740], 1), sparse,
               (torch.arange(90), 0, perm[1800:1890], 1)]  # fmt: skip
    batch = build_forward_batch(decode, prefill, pool.device, pool.pad_slot)
    rows = batch.num_tokens
    q, k, v = torch.randn(rows, 14, 64), torch.randn(rows, 2, 64), torch.randn(rows, 2, 64)
    fast = attention.paged_attention(0, q, k, v, batch, pool, 0.125)
    monkeypatch.setattr(native, "paged_ops", lambda: None)
    slow = attention.paged_attention(0, q, k, v, batch, pool, 0.125)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
    if fmt.key_order is not None:  # the same rows read as if stored in the computed order
        plain = KVPool(KVShape(1, 2, 64, torch.float32, kv_format=fmt.with_key_order(None)), 3000)
        plain.k.copy_(pool.k), plain.v.copy_(pool.v)
        unordered = attention.paged_attention(0, q, k, v, batch, plain, 0.125)
        assert not torch.allclose(unordered, slow, rtol=1e-2, atol=1e-2)


def test_paged_attention_answers_in_the_queries_dtype(ops):
    """A bfloat16 model's queries: the native kernel computes in float32, the step gets
    bfloat16 back (as the PyTorch path gives)."""
    shape = KVShape(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    pool = KVPool(shape, 64)
    batch = build_forward_batch([], [(torch.arange(8), 0, torch.arange(8), 1)], pool.device,
                                pool.pad_slot)  # fmt: skip
    q, k, v = (torch.randn(8, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    out = attention.paged_attention(0, q, k, v, batch, pool, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
