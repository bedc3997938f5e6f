"""GGUF block formats kept as the file's bytes (Q5_0, Q5_1, K-quants) and stacked weights.

Each format's native dequantization (the vector code and its plain C++ twin) must give what
the ``gguf`` package gives on random blocks, and the native matmul (integer dot products for
few rows, float lanes for many, dequantize + BLAS beyond) must equal ``x @ dequantize(W).T``
(x kept in float: ``test_int8_rows.py`` checks x rounded to int8).
A model file mixing the formats as a Q4_K_M file does must compute, kept quantized, what the
same file computes dequantized.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_int8_rows import few_rows_take_int8
from test_quantization import gguf_model, run_steps, tiny_q4_gguf  # noqa: F401 (a fixture)

from radixserve.cache import KVPool
from radixserve.model import build_forward_batch, loader, native
from radixserve.model.quant import GGUF_BLOCKS, QuantizedWeight, from_gguf_blocks
from testing.gguf_writer import random_blocks, write_llama_gguf
from testing.tiny_model import save_tiny_hf_model

Q = gguf.GGMLQuantizationType
BLOCK_TYPES = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# rows of x: the integer kernel in groups of 4, the float lanes (8+), dequantize + BLAS (129+)
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 17, 70, 140)


def dequantized(raw: np.ndarray, qtype: str) -> torch.Tensor:
    w = gguf.quants.dequantize(raw, Q[qtype]).reshape(raw.shape[0], -1)
    return torch.from_numpy(w.astype(np.float32))


def block_weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    """A random weight of ``qtype`` and its bytes."""
    raw = random_blocks(n, k, Q[qtype], np.random.default_rng(seed))
    return from_gguf_blocks(raw, qtype, (n, k)), raw


# the codes' bytes of the formats with a min (w = scale * q + min): zeroed, a block is its min
CODE_BYTES = {"Q5_1": slice(4, 24), "Q4_K": slice(16, 144), "Q5_K": slice(16, 176)}


def integer_reference(x: torch.Tensor, raw: np.ndarray, qtype: str) -> torch.Tensor:
    """What the integer kernels compute: x rounded to int16 per block of 32 (own scale each)
    meets the codes; the mins meet x's exact block sums."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    seen = (torch.round(blocks * inv) * d).reshape(x.shape)
    ref = seen @ dequantized(raw, qtype).T
    if qtype in CODE_BYTES:
        size = gguf.GGML_QUANT_SIZES[Q[qtype]][1]
        mins = raw.reshape(raw.shape[0], -1, size).copy()
        mins[..., CODE_BYTES[qtype]] = 0
        ref += (x - seen) @ dequantized(mins.reshape(raw.shape[0], -1), qtype).T
    return ref


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_block_formats_dequantize_as_gguf_does(qtype, ops):
    weight, raw = block_weight(qtype, 37, 512)
    assert weight.fmt == qtype.lower() and weight.shape == (37, 512)
    assert weight.qs.dtype == torch.uint8 and weight.d is None  # the file's bytes, untouched
    ref = dequantized(raw, qtype)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    # one rounding apart at most: (d * sc) * q - dmin * m against a fused multiply-add
    assert close(weight.dequantize(), ref, 1e-6)
    assert close(ops.dequantize_reference(weight.native_view()), ref, 1e-6)
    ids = torch.tensor([5, 0, 36, 5])
    assert close(weight.embedding(ids, torch.float32), ref[ids], 1e-6)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_block_format_matmul_equals_dequantized_matmul(qtype, ops, float_activations):
    n, k = 45, 768  # N not a multiple of the 3- or 12-row tiles; K three K-quant blocks
    weight, raw = block_weight(qtype, n, k, seed=1)
    dense = dequantized(raw, qtype)
    gen = torch.Generator().manual_seed(2)
    for m in ROW_COUNTS:
        x = torch.randn(m, k, generator=gen)
        x[:, 5] *= 30  # an outlier input, as real activations have
        ref = x @ dense.T
        # up to 7 rows, x is rounded to int16 per block of 32 (up to 1e-4 of a product with
        # the outlier's block), and the kernels compute exactly that up to float
        # rounding; Q2_K and Q3_K use the float path
        # (a build without AVX2 runs the float tiles instead: the float reference)
        y = ops.qgemm(x, weight.native_view())
        if m < 8 and qtype not in ("Q2_K", "Q3_K") and not close(y, ref, 1e-5):
            ref = integer_reference(x, raw, qtype)
        assert close(y, ref, 1e-5), m
        base = torch.randn(m, n, generator=gen)
        out = ops.qgemm(x, weight.native_view(), base.clone())
        assert close(out - base, ref, 1e-5), m
        assert close(weight.matmul(x), ref, 1e-5), m  # the Python entry (x kept in float)


def test_stacked_weights_of_mixed_formats(ops):
    k = 512
    parts = [block_weight(t, n, k, seed=i) for i, (t, n) in
             enumerate([("Q5_0", 20), ("Q6_K", 7), ("Q4_K", 13)])]  # fmt: skip
    q8 = gguf.quants.quantize(np.random.default_rng(9).normal(0, 0.2, (11, k)), Q.Q8_0)
    parts.append((from_gguf_blocks(q8, "Q8_0", (11, k)), q8))
    types = ["Q5_0", "Q6_K", "Q4_K", "Q8_0"]
    stacked = QuantizedWeight.cat([w for w, _ in parts])
    dense = torch.cat([dequantized(raw, t) for (_, raw), t in zip(parts, types, strict=True)])
    assert stacked.fmt == "stack" and stacked.shape == (51, k)
    assert stacked.parts[0].qs.data_ptr() == parts[0][0].qs.data_ptr()  # no copy
    assert close(stacked.dequantize(), dense, 1e-6)
    ids = torch.tensor([50, 0, 19, 20, 27, 26, 40])  # rows of every piece and their seams
    assert close(stacked.embedding(ids, torch.float32), dense[ids], 1e-6)
    for m in ROW_COUNTS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        ref = x @ dense.T
        y = ops.qgemm(x, stacked.native_view())
        if m < 8 and not close(y, ref, 1e-5):  # the integer kernel (AVX2 builds)
            ref = torch.cat([integer_reference(x, raw, t) for (_, raw), t in
                             zip(parts, types, strict=True)], 1)  # fmt: skip
        assert close(y, ref, 1e-5), m
    with pytest.raises(ValueError, match="same inputs"):
        QuantizedWeight.cat([parts[0][0], block_weight("Q4_K", 4, 256)[0]])


def test_block_format_without_kernels_uses_gguf(monkeypatch):
    weight, raw = block_weight("Q4_K", 6, 256)
    monkeypatch.setattr(native, "paged_ops", lambda: None)
    assert torch.equal(weight.dequantize(), dequantized(raw, "Q4_K"))


def test_every_kept_format_has_a_native_code():
    from radixserve.model.quant import FORMAT_CODES, GGUF_FORMATS

    assert set(GGUF_FORMATS.values()) <= FORMAT_CODES.keys()
    assert {t.lower() for t in BLOCK_TYPES} == GGUF_BLOCKS.keys()


# a Q4_K_M-like mix: Q5_0 attention and gate/up, Q8_0 V, K-quant down projections and
# embedding (the widths are multiples of 256, as K-quants need)
MIX = {"attn_v": Q.Q8_0, "ffn_down": Q.Q6_K, "ffn_gate": Q.Q4_K, "token_embd": Q.Q5_K}


@pytest.fixture(scope="module")
def tiny_mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant")
    hf = save_tiny_hf_model(path / "hf", seed=4, hidden_size=256, intermediate_size=512)
    write_llama_gguf(hf, path / "mixed.gguf", Q.Q5_0, types=MIX)
    return path / "mixed.gguf"


def test_a_prompt_chunk_beside_decodes_runs_on_the_blocks(tiny_mixed_gguf, ops, monkeypatch):
    """A step of 110 prompt rows and 10 decode rows on a file mixing formats as Q4_K_M does
    multiplies every matrix on its blocks (dequantizing the model would cost a step more
    than its matmuls) and computes what the dequantized file computes, up to x's rounding."""
    quantized, dense = gguf_model(tiny_mixed_gguf, "auto"), gguf_model(tiny_mixed_gguf, "none")

    def refuse(self, *args):
        pytest.fail(f"dequantized a {self.fmt} matrix")

    monkeypatch.setattr(QuantizedWeight, "dequantize", refuse)
    decode = [(7 * i + 3, 4, torch.arange(5 * i, 5 * i + 5)) for i in range(10)]
    prompt = (torch.arange(110) * 37 % 1000 + 5, 0, torch.arange(50, 160), True)
    logits = []
    for model in (quantized, dense):
        pool = KVPool(model.kv_shape(), 200)
        pool.k.zero_(), pool.v.zero_()  # the decode rows' contexts: the same in both pools
        batch = build_forward_batch(decode, [prompt], model.device, pool.pad_slot)
        logits.append(model.forward(batch, pool))
    ours, ref = logits
    assert ours.shape == (11, ref.shape[1])
    assert (ours - ref).abs().max() < 0.06 * ref.abs().max()  # int8 x: ~3% on this model


def test_mixed_quantized_model_equals_its_dequantized_self(tiny_mixed_gguf, ops, float_activations):
    quantized, dense = gguf_model(tiny_mixed_gguf, "auto"), gguf_model(tiny_mixed_gguf, "none")
    layer = quantized.layers[0]
    assert layer["qkv"].fmt == "stack"  # Q5_0, Q5_0, Q8_0
    assert [p.fmt for p in layer["qkv"].parts] == ["q5_0", "q5_0", "q8_0"]
    assert layer["down"].fmt == "q6_k" and quantized.embed.fmt == "q5_k"
    assert [p.fmt for p in layer["gate_up"].parts] == ["q4_k", "q5_0"]
    assert isinstance(dense.layers[0]["down"], torch.Tensor)
    ours, tokens = run_steps(quantized)
    assert quantized._native[1] is not None  # the decode steps ran in the native decoder
    ref, ref_tokens = run_steps(dense)
    assert (ours - ref).abs().max() < 1e-3 * ref.abs().max()
    assert tokens == ref_tokens


def test_auto_dtype_is_float32_for_files_kept_in_q5_or_k_quant_blocks(
    tiny_mixed_gguf,
    tiny_q4_gguf,  # noqa: F811
    ops,
    monkeypatch,
):
    """On a CPU with native bfloat16, ``auto`` keeps bfloat16 for a Q4_1 file but is float32
    for one kept in GGUF's Q5 / K-quant blocks (their kernels take float32 inputs), unless
    the dtype is given or the weights are dequantized."""
    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: True)

    def dtype(path, **kw):
        return loader.load_model(path, progress=False, **kw).model.dtype

    assert dtype(tiny_mixed_gguf) == torch.float32
    assert dtype(tiny_mixed_gguf, dtype="bfloat16") == torch.bfloat16
    assert dtype(tiny_mixed_gguf, quantization="none") == torch.bfloat16
    assert dtype(tiny_q4_gguf) == torch.bfloat16


def test_one_sequence_rounds_q5_and_k_quant_inputs_to_int8_unless_turned_off(tiny_mixed_gguf, ops):
    """A single sequence's decode steps (the native decoder) round x to int8 in the Q5 /
    K-quant matmuls (their few-row kernel), which moves the logits a little; with the switch
    off they take the int16 path, as close to the dequantized file as before."""
    model = gguf_model(tiny_mixed_gguf, "auto")
    int8, _ = run_steps(model, sequences=1)
    assert torch.equal(run_steps(model, sequences=1)[0], int8)  # deterministic
    try:
        int16_decode, _ = run_steps(model, sequences=1, before_decode=lambda: ops.use_int8_lanes(0))
        ops.use_int8_lanes(0)
        int16, _ = run_steps(model, sequences=1)
    finally:
        ops.use_int8_lanes(1)
    assert model._native is not None and model._native[1] is not None  # decoded natively
    assert torch.equal(int16_decode[0], int8[0])  # the same prefill, then
    dense, _ = run_steps(gguf_model(tiny_mixed_gguf, "none"), sequences=1)
    scale = dense.abs().max()
    assert (int16 - dense).abs().max() < 1e-3 * scale
    if not few_rows_take_int8(model.layers[0]["down"]):  # the plain C++ build: float paths
        assert torch.equal(int16_decode, int8)
        return
    assert not torch.equal(int16_decode[1:], int8[1:])  # the switch changed the decode steps
    assert 1e-4 * scale < (int8 - dense).abs().max() < 0.06 * scale
