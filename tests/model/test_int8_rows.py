"""The batched integer matmul: x rounded to int8 per block of 32, W's codes as bytes.

With ``int8=True`` (what the native decoder asks for on batches of 8 sequences or more, and
``QuantizedWeight.matmul`` for 8 rows or more of a weight in GGUF block formats, prompt
chunks included), ``qgemm`` must compute exactly ``round_int8(x) @ dequantize(W).T`` up to
float summation order, for every format it takes (the file's blocks checked against the
``gguf`` package's dequantization), stacks mixing formats included; fewer rows, and formats
it does not take, keep their own paths; with ``alone``, any number of rows takes the few-row
paths, each row getting the numbers it gets alone. A step's rows up to a few hundred never
dequantize such a matrix. The older CPUs' builds (AVX2 without VNNI, plain C++) are checked by
a slow test that builds them on this machine.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from test_quantization import gguf_model, run_steps, tiny_q4_gguf  # noqa: F401 (a fixture)

from radixserve.model.quant import (
    INT8_M_BLOCKS,
    SMALL_M_BLOCKS,
    QuantizedWeight,
    from_gguf_blocks,
    quantize,
)
from testing.gguf_writer import random_blocks

Q = gguf.GGMLQuantizationType
FILE_TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1"]
ROWS = (8, 9, 16, 17, 33)  # one lane group, a part of one, two, two and a part, four and one


def file_weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A weight of ``qtype`` as a GGUF file holds it, and its dequantization by ``gguf``."""
    rng = np.random.default_rng(seed)
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        raw = gguf.quants.quantize(rng.normal(0, 0.2, (n, k)).astype(np.float32), Q[qtype])
    else:
        raw = random_blocks(n, k, Q[qtype], rng)
    dense = gguf.quants.dequantize(raw, Q[qtype]).reshape(n, k).astype(np.float32)
    return from_gguf_blocks(raw, qtype, (n, k)), torch.from_numpy(dense)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: each block of 32 on its own grid of max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


def outlier_rows(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 5] *= 30  # an outlier input, as real activations have: its block loses precision
    return x


def cpu_flags() -> set[str] | None:
    try:
        return set(open("/proc/cpuinfo").read().split())
    except OSError:
        return None


def q8_0_takes_int8() -> bool:
    """Whether this build's int8 path takes Q8_0: not on AVX2 without VNNI (the AVX2 build,
    or the native build on such a CPU), where the pair sums of its byte codes could
    saturate; a weight with Q8_0 rows keeps the float path there."""
    isa = os.environ.get("RADIXSERVE_NATIVE_ISA")
    if isa in ("avx2", "portable"):
        return isa == "portable"
    flags = cpu_flags()
    if flags is None:
        return True
    vnni = {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags
    return "avx2" not in flags or vnni


def few_rows_take_int8(weight: QuantizedWeight) -> bool:
    """Whether 1-7 rows with ``int8=True`` round x to int8 (int8_few_rows.cpp): for GGUF's
    Q5 and K-quant formats (every piece of a stack), on builds with AVX2; other formats and
    the plain C++ build keep their path without int8."""
    formats = [p.fmt for p in weight.parts] if weight.fmt == "stack" else [weight.fmt]
    flags = cpu_flags() or set()
    avx2 = os.environ.get("RADIXSERVE_NATIVE_ISA") != "portable" and "avx2" in flags
    return avx2 and all(f in ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k") for f in formats)


def check_int8(ops, weight: QuantizedWeight, dense: torch.Tensor, takes_int8: bool = True) -> None:
    view = weight.native_view()
    assert view.int8_lanes == takes_int8
    if not takes_int8:  # the path without int8, exactly (test_gguf_formats checks that one)
        x = outlier_rows(ROWS[0], dense.shape[1])
        assert torch.equal(ops.qgemm(x, view, int8=True), ops.qgemm(x, view))
        return
    for m in ROWS:
        x = outlier_rows(m, dense.shape[1])
        ref = int8_rounded(x) @ dense.T
        y = ops.qgemm(x, view, int8=True)
        assert close(y, ref, 1e-5), m
        assert not close(y, x @ dense.T, 1e-4), m  # it did round x: not the float path
        base = torch.randn(m, dense.shape[0])
        assert close(ops.qgemm(x, view, base.clone(), int8=True) - base, ref, 1e-5), m
    for m in (1, 3, 7):  # fewer rows than a lane group: their own path
        x = outlier_rows(m, dense.shape[1])
        y = ops.qgemm(x, view, int8=True)
        if not few_rows_take_int8(weight):
            assert torch.equal(y, ops.qgemm(x, view)), m
            continue
        assert close(y, int8_rounded(x) @ dense.T, 1e-5), m
        assert not close(y, x @ dense.T, 1e-4), m
        # each row computed on its own: the same numbers whatever rows come with it
        alone = [ops.qgemm(x[i : i + 1], view, int8=True) for i in range(m)]
        assert torch.equal(y, torch.cat(alone)), m
        base = torch.randn(m, dense.shape[0])
        assert torch.equal(ops.qgemm(x, view, base.clone(), int8=True), base + y), m
    check_rows_alone(ops, view, dense.shape[1])


def check_rows_alone(ops, view, k: int) -> None:
    """With ``alone`` (the decoder's draft rows in a batch of few sequences), any number of
    rows (up to several passes of 16) gets exactly the numbers each row gets alone, with int8
    and without, whatever path a lone row takes."""
    x = outlier_rows(37, k)
    for int8 in (True, False):
        one = torch.cat([ops.qgemm(x[i : i + 1], view, int8=int8) for i in range(len(x))])
        for m in (2, 5, 8, 16, 37):
            assert torch.equal(ops.qgemm(x[:m], view, int8=int8, alone=True), one[:m]), (m, int8)


@pytest.mark.parametrize("qtype", FILE_TYPES)
def test_int8_rows_compute_rounded_x_times_the_weights(qtype, ops):
    weight, dense = file_weight(qtype, 45, 768)  # 45: tiles of 4 rows and a part
    check_int8(ops, weight, dense, qtype != "Q8_0" or q8_0_takes_int8())


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_int8_rows_of_q5_rows_ending_in_a_partial_group(qtype, ops):
    # 28 blocks a row (Qwen2.5-0.5B's 896 inputs): the few-row path takes 8 at a time, then 4
    weight, dense = file_weight(qtype, 13, 896)
    check_int8(ops, weight, dense)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_matmul_rounds_prompt_rows_to_int8_without_dequantizing(qtype, ops, monkeypatch):
    """Up to its row limit, ``matmul`` (the op-by-op path of prompt chunks) multiplies a block
    format's weight on its blocks with x rounded to int8, in x's dtype, never dequantizing W;
    beyond it, BLAS on the dequantized matrix; with the switch off, float lanes up to their
    own limit."""
    int8_rows = INT8_M_BLOCKS
    weight, dense = file_weight(qtype, 24, 256)
    view = weight.native_view()
    dequantized = []
    real = QuantizedWeight.dequantize
    monkeypatch.setattr(QuantizedWeight, "dequantize",
                        lambda self, *a: dequantized.append(self) or real(self, *a))  # fmt: skip
    for m in (8, 40, int8_rows):
        x = outlier_rows(m, 256)
        assert torch.equal(weight.matmul(x), ops.qgemm(x, view, int8=True)), m
        y = weight.matmul(x.bfloat16())
        assert y.dtype == torch.bfloat16
        assert close(y.float(), ops.qgemm(x.bfloat16().float(), view, int8=True), 1e-2), m
    assert not dequantized
    x = outlier_rows(int8_rows + 1, 256)
    assert close(weight.matmul(x), x @ dense.T, 1e-5) and dequantized == [weight]
    try:
        ops.use_int8_lanes(0)
        x = outlier_rows(40, 256)
        assert torch.equal(weight.matmul(x), ops.qgemm(x, view))
        x = outlier_rows(SMALL_M_BLOCKS, 256)
        assert torch.equal(weight.matmul(x), ops.qgemm(x, view))
    finally:
        ops.use_int8_lanes(1)
    assert dequantized == [weight]


def test_q4_1_prompt_rows_keep_x_in_float(ops):
    weight, _ = file_weight("Q4_1", 24, 256)
    x = outlier_rows(40, 256)
    assert torch.equal(weight.matmul(x), ops.qgemm(x, weight.native_view()))


def test_int8_rows_of_quantized_dense_weights(ops):
    w = torch.randn(21, 96, generator=torch.Generator().manual_seed(0)) * 0.2
    for fmt in ("q8_0", "q4_1"):
        weight = quantize(w, fmt)
        check_int8(ops, weight, weight.dequantize(), fmt != "q8_0" or q8_0_takes_int8())


def test_int8_rows_of_a_stack_mixing_formats(ops):
    # tiles of 4 rows cross the seams, so one tile mixes Q6_K's per-16 scales with a real min
    pieces = [file_weight(t, n, 512, seed=i) for i, (t, n) in
              enumerate([("Q5_0", 20), ("Q6_K", 7), ("Q4_K", 13), ("Q8_0", 11)])]  # fmt: skip
    stacked = QuantizedWeight.cat([w for w, _ in pieces])
    assert stacked.fmt == "stack"
    check_int8(ops, stacked, torch.cat([d for _, d in pieces]), q8_0_takes_int8())


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
def test_formats_without_byte_codes_keep_the_float_path(qtype, ops):
    weight, dense = file_weight(qtype, 12, 256)
    x = outlier_rows(16, 256)
    y = ops.qgemm(x, weight.native_view(), int8=True)
    assert torch.equal(y, ops.qgemm(x, weight.native_view()))
    assert close(y, x @ dense.T, 1e-5)


def test_decoder_batches_round_to_int8_unless_turned_off(tiny_q4_gguf, ops):  # noqa: F811
    """Nine sequences decode in one batch: int8 moves the logits a little, the switch
    restores the float path."""
    assert ops.use_int8_lanes()  # the default (RADIXSERVE_INT8_LANES unset)
    model = gguf_model(tiny_q4_gguf, "auto")
    int8, tokens = run_steps(model, sequences=9)
    try:
        ops.use_int8_lanes(0)
        floats, float_tokens = run_steps(model, sequences=9)
    finally:
        ops.use_int8_lanes(1)
    dense, _ = run_steps(gguf_model(tiny_q4_gguf, "none"), sequences=9)
    assert (floats - dense).abs().max() < 1e-3 * dense.abs().max()
    assert int8[:9].equal(floats[:9])  # Q4_1 prompt rows keep float (quant.py)
    # the first decode step (later ones may follow another greedy token): this tiny random
    # model amplifies int8 rounding to ~3% of its logits, as it does int8 weights
    first = slice(9, 18)
    err = (int8[first] - dense[first]).abs().max() / dense[first].abs().max()
    assert 1e-4 < err < 0.06


CHILD = """
from radixserve.model import native
ops = native.paged_ops()
assert ops is not None, "the build failed"
print(ops.__name__)
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction sets")
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_older_cpus_paths(isa, ops):
    """Build the kernels as an AVX2-only (no VNNI, no AVX-512) or a plain C++ CPU would, and
    run the format and int8 tests on them (each build takes a few minutes)."""
    env = {**os.environ, "RADIXSERVE_NATIVE_ISA": isa}
    built = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert built.stdout.strip() != ops.__name__  # another build, not this machine's
    tests = [__file__, os.path.join(os.path.dirname(__file__), "test_gguf_formats.py")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *tests], env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
