"""Weights kept quantized: formats, the native matmul and decoder, and --quantization.

Every quantized path must compute the dequantized model's function (up to float summation
order): blocks read from a GGUF file dequantize to exactly what the ``gguf`` package gives,
the native matmul equals ``x @ dequantize(W).T`` for every row count and format, and a
quantized model's logits equal the same file loaded with ``quantization="none"``, through the
op-by-op path and through the native decoder alike.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radixserve.cache import KVPool
from radixserve.config import EngineConfig
from radixserve.model import LlamaModel, build_forward_batch, load_model, native
from radixserve.model.gguf_loader import load_gguf
from radixserve.model.quant import QuantizedWeight, from_gguf_blocks, quantize
from testing.gguf_writer import write_llama_gguf
from testing.tiny_model import save_tiny_hf_model

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_as_gguf_does(qtype, kernels):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (40, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q[qtype])
    expected = gguf.quants.dequantize(raw, Q[qtype]).reshape(w.shape)
    weight = from_gguf_blocks(raw, qtype, w.shape)
    assert weight.shape == w.shape
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
    ids = torch.tensor([3, 0, 39, 3])
    rows = torch.from_numpy(expected[[3, 0, 39, 3]])
    assert torch.equal(weight.embedding(ids, torch.float32), rows)


def test_native_kernels_use_every_torch_thread():
    ops = native.paged_ops()
    if ops is None:
        pytest.skip("the native kernels did not build on this machine")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # a one-core CI box still runs two OpenMP threads
        assert ops.parallel_threads(64) == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_quantize_rounds_each_weight_to_its_block_grid(fmt):
    torch.manual_seed(0)
    w = torch.randn(24, 64) * torch.rand(24, 1)
    weight = quantize(w, fmt)
    step = weight.d.repeat_interleave(32, dim=1)
    err = (weight.dequantize() - w).abs()
    assert (err <= step / 2 + 1e-6).all()  # nearest grid point: at most half a step away
    assert (err > 0).any()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 40), fmt)


def make_weight(fmt: str, n: int, k: int) -> torch.Tensor | QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.2
    return w if fmt == "f32" else quantize(w, fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "f32"])
def test_native_matmul_equals_dequantized_matmul(fmt):
    ops = native.paged_ops()
    if ops is None:
        pytest.skip("the native kernels did not build on this machine")
    n, k = 70, 96  # N not a multiple of the 3- or 12-row tiles
    w = make_weight(fmt, n, k)
    if isinstance(w, QuantizedWeight):
        view, dense = w.native_view(), w.dequantize()
    else:
        view, dense = ops.QWeight(0, n, k, w, None, None), w
    assert ops.qgemm(torch.randn(0, k), view).shape == (0, n)
    # the integer kernel (rows in groups of 4), the few-row float tiles, the float lanes (8+ rows:
    # a 16-row block, then 8 or fewer; 70 rows: four blocks and a part)
    for m in (1, 2, 3, 4, 5, 9, 17, 70):
        x = torch.randn(m, k)
        ref = x @ dense.T
        # up to 64 rows of x meet quantized weights rounded to int16 per block: ~1e-5 relative
        tol = 1e-4 * ref.abs().max().item() if fmt != "f32" and m <= 64 else 1e-5
        assert (ops.qgemm(x, view) - ref).abs().max() <= tol, m
        base = torch.randn(m, n)
        out = ops.qgemm(x, view, base.clone())  # accumulate into out
        assert (out - (base + ref)).abs().max() <= tol + 1e-5, m
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.qgemm(torch.randn(2, k + 32), view)


def test_matmul_paths_agree(monkeypatch):
    w = make_weight("q4_1", 64, 128)
    for m in (2, 40):  # native small-row kernel / dequantize + BLAS
        x = torch.randn(m, 128)
        fast = w.matmul(x)
        with monkeypatch.context() as patch:
            patch.setattr(native, "paged_ops", lambda: None)
            slow = w.matmul(x)
        assert (fast - slow).abs().max() <= 1e-4 * slow.abs().max()


@pytest.fixture(scope="module")
def tiny_q4_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4")
    hf = save_tiny_hf_model(path / "hf", seed=3)
    write_llama_gguf(hf, path / "tiny.gguf", Q.Q4_1)
    return path / "tiny.gguf"


def gguf_model(path, quantization: str) -> LlamaModel:
    return LlamaModel(*load_gguf(path, progress=False, quantization=quantization))


PROMPTS = [[17, 934, 2210, 77, 5, 9001, 312], [48, 1200, 6, 815], [40000, 27, 3333, 91, 12, 4]]


def run_steps(
    model, decode_steps: int = 4, sequences: int = 3, before_decode=None
) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill ``sequences`` prompts in one step, then decode them together greedily;
    scattered slots (up to 10 sequences). ``before_decode()`` runs between the two."""
    prompts = PROMPTS + [[(i * 7919 + j * 104729) % 30000 + 5 for j in range(3 + i % 5)]
                         for i in range(len(PROMPTS), sequences)]  # fmt: skip
    prompts = prompts[:sequences]
    pool = KVPool(model.kv_shape(), 400)
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(0))
    slots = [perm[40 * i : 40 * (i + 1)] for i in range(sequences)]
    prefill = [(torch.tensor(p), 0, s[: len(p)], True) for p, s in zip(prompts, slots, strict=True)]
    batch = build_forward_batch([], prefill, model.device, pool.pad_slot)
    logits = [model.forward(batch, pool)]
    tokens = [[int(t)] for t in logits[0].argmax(-1)]
    lens = [len(p) for p in prompts]
    if before_decode is not None:
        before_decode()
    for _ in range(decode_steps):
        decode = [(t[-1], n, s[: n + 1]) for t, n, s in zip(tokens, lens, slots, strict=True)]
        batch = build_forward_batch(decode, [], model.device, pool.pad_slot)
        logits.append(model.forward(batch, pool))
        for t, row in zip(tokens, logits[-1], strict=True):
            t.append(int(row.argmax()))
        lens = [n + 1 for n in lens]
    return torch.cat(logits), tokens


def test_quantized_model_equals_the_dequantized_model(tiny_q4_gguf, kernels):
    quantized, dense = gguf_model(tiny_q4_gguf, "auto"), gguf_model(tiny_q4_gguf, "none")
    assert isinstance(quantized.layers[0]["gate_up"], QuantizedWeight)
    assert quantized.embed.fmt == "q4_1"
    assert isinstance(dense.layers[0]["gate_up"], torch.Tensor)
    ours, tokens = run_steps(quantized)
    ref, ref_tokens = run_steps(dense)
    # decode steps round x to int16 per block (~1e-5 relative a matmul), which this tiny
    # random model amplifies to a few 1e-4 of its logits
    assert (ours - ref).abs().max() < 1e-3 * ref.abs().max()
    assert tokens == ref_tokens


def test_native_decoder_equals_the_op_by_op_path(tiny_q4_gguf, monkeypatch):
    if native.paged_ops() is None:
        pytest.skip("the native kernels did not build on this machine")
    for quantization in ("auto", "none"):
        model = gguf_model(tiny_q4_gguf, quantization)
        fast, _ = run_steps(model)
        assert model._native is not None and model._native[1] is not None  # it did run natively
        model._native = None
        with monkeypatch.context() as patch:
            patch.setattr(native, "paged_ops", lambda: None)
            slow, _ = run_steps(model)
        assert (fast - slow).abs().max() < 1e-3 * slow.abs().max(), quantization


# The tiny random model amplifies rounding (its weights are drawn wide, so greedy choices are
# not near-ties): int8 moves its logits by ~3%, int4 by ~40%. The default model's figures
# (agreement, perplexity) are in docs/benchmarks.md.
@pytest.mark.parametrize("quantization, fmt, tol", [("int8", "q8_0", 0.06), ("int4", "q4_1", 0.6)])
def test_int8_and_int4_quantize_a_dense_model(tiny_model_dir, quantization, fmt, tol):
    dense = load_model(str(tiny_model_dir), dtype="float32", progress=False).model
    model = load_model(str(tiny_model_dir), dtype="float32", progress=False,
                       quantization=quantization).model  # fmt: skip
    assert model.layers[0]["qkv"].fmt == fmt and model.layers[1]["down"].fmt == fmt
    assert model.embed.fmt == "q8_0"
    ours, _ = run_steps(model, decode_steps=0)  # the same inputs: the prompts
    ref, _ = run_steps(dense, decode_steps=0)
    assert (ours - ref).norm() / ref.norm() < tol  # rounding error, not a different function
    assert (ours - ref).abs().max() > 0  # and it really is quantized


def test_bad_quantization_is_an_error(capsys):
    from radixserve.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--quantization", "int3"])
    assert exit_info.value.code == 2
    assert "argument --quantization: invalid choice: 'int3'" in capsys.readouterr().err
    assert build_parser().parse_args(["serve"]).quantization == "auto"  # the file's own types
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig.from_options(quantization="int3")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(None, quantization="fp8")


def test_without_native_kernels_quantized_weights_load_dense(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(native, "paged_ops", lambda: None)  # e.g. no compiler on this machine
    model = load_model(str(tiny_model_dir), dtype="float32", progress=False,
                       quantization="int8").model  # fmt: skip
    assert isinstance(model.layers[0]["qkv"], torch.Tensor)  # not dequantized at every step
    assert isinstance(model.embed, torch.Tensor)
