"""Our forward pass against transformers on the same weights.

Covered: prefill from scratch, prefill after a cached prefix, decode, and one packed step that
mixes decode tokens with prefill chunks; for Llama, Mistral, Qwen2 (QKV bias), Llama-3 RoPE
scaling; for GGUF files of several tensor types (kept quantized, as ``--quantization auto``
loads them); and for the real default model. Decode steps run both through the native layer
stack and op by op in PyTorch (the ``kernels`` fixture).
"""

from __future__ import annotations

import gguf
import pytest
import torch

from radixserve.cache import KVPool
from radixserve.model import build_forward_batch, load_model
from testing.gguf_writer import write_llama_gguf
from testing.tiny_model import save_tiny_hf_model

PROMPT = [17, 934, 2210, 77, 5, 9001, 312, 48, 1200, 6, 815, 40000, 27, 3333, 91, 12]


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


class Runner:
    """Drives our model through prefill / decode steps with slots 0, 1, 2, ... per sequence."""

    def __init__(self, model, num_slots: int = 512, kv_format=None):
        self.model = model
        shape = model.kv_shape()
        self.pool = KVPool(shape if kv_format is None else shape.with_format(kv_format), num_slots)

    def step(self, decode=(), prefill=(), all_logits: bool = False) -> torch.Tensor:
        batch = build_forward_batch(
            list(decode), list(prefill), self.model.device, self.pool.pad_slot
        )
        if all_logits:
            batch.logits_indices = torch.arange(batch.num_tokens)
        return self.model.forward(batch, self.pool)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff < tol, f"max |ours - transformers| = {diff:.3g} >= {tol}"


VARIANTS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 4096}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_pair(request, tmp_path_factory, default_tokenizer):
    cls, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_hf_model(path, cls, seed=1, **overrides).eval()
    default_tokenizer.hf.save_pretrained(path)
    if request.param == "qwen2":  # random biases, so the bias path is really exercised
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
        hf.save_pretrained(path)
    return hf, load_model(str(path), dtype="float32", progress=False).model


def test_prefill_from_scratch(tiny_pair):
    hf, model = tiny_pair
    logits = Runner(model).step(
        prefill=[(torch.tensor(PROMPT), 0, torch.arange(16), True)], all_logits=True
    )
    assert_close(logits, reference_logits(hf, PROMPT), 5e-5)


def test_prefill_after_cached_prefix_then_decode(tiny_pair, kernels):
    hf, model = tiny_pair
    ref = reference_logits(hf, PROMPT)
    run = Runner(model)
    run.step(prefill=[(torch.tensor(PROMPT[:9]), 0, torch.arange(9), False)])
    logits = run.step(
        prefill=[(torch.tensor(PROMPT[9:13]), 9, torch.arange(13), True)], all_logits=True
    )
    assert_close(logits, ref[9:13], 5e-5)
    for pos in range(13, 16):
        logits = run.step(decode=[(PROMPT[pos], pos, torch.arange(pos + 1))])
        assert_close(logits[0], ref[pos], 5e-5)


def test_mixed_step_of_decodes_and_chunks(tiny_pair, kernels):
    hf, model = tiny_pair
    a, b, c = PROMPT, PROMPT[::-1], PROMPT[3:] + PROMPT[:5]
    run = Runner(model)
    slots_a, slots_b, slots_c = torch.arange(0, 16), torch.arange(100, 116), torch.arange(200, 216)
    run.step(
        prefill=[
            (torch.tensor(a[:10]), 0, slots_a[:10], False),
            (torch.tensor(b[:6]), 0, slots_b[:6], False),
            (torch.tensor(c[:4]), 0, slots_c[:4], False),
        ]
    )
    logits = run.step(
        decode=[(a[10], 10, slots_a[:11]), (b[6], 6, slots_b[:7])],
        prefill=[(torch.tensor(c[4:12]), 4, slots_c[:12], True)],
    )
    assert_close(logits[0], reference_logits(hf, a[:11])[-1], 5e-5)
    assert_close(logits[1], reference_logits(hf, b[:7])[-1], 5e-5)
    assert_close(logits[2], reference_logits(hf, c[:12])[-1], 5e-5)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_tensor_types_match_transformers(qtype, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = save_tiny_hf_model(tmp_path / "hf", seed=2)
    write_llama_gguf(hf, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType[qtype])
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").eval()
    from radixserve.model.gguf_loader import load_gguf
    from radixserve.model.llama import LlamaModel

    config, weights = load_gguf(tmp_path / "tiny.gguf", progress=False)
    model = LlamaModel(config, weights)
    logits = Runner(model).step(
        prefill=[(torch.tensor(PROMPT), 0, torch.arange(16), True)], all_logits=True
    )
    expected = reference_logits(ref, PROMPT)
    if qtype.startswith("Q"):  # 16 rows: the integer kernels (x rounded to int16 per block)
        assert_close(logits, expected, 3e-3)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    else:
        assert_close(logits, expected, 5e-5)
    if qtype == "F32":  # lossless: also equal to the model it was written from
        assert_close(logits, reference_logits(hf, PROMPT), 5e-5)


@pytest.fixture(scope="module")
def real_reference(default_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name
    ).eval()


def test_real_default_model_matches_transformers(real_loaded, real_reference):
    """The file's Q4_1/Q8_0 blocks kept quantized (``--quantization auto``) against
    transformers' float32 dequantization of the same file. Matmuls of up to 64 rows (decode
    steps, and this short prompt's chunks) round activations to int16 per block of 32 for
    the integer kernels: ~1e-5 of a block's largest value, more for its small entries next
    to an outlier, so logits (about +-30) move by up to ~0.02; the greedy choice must not."""
    tok = real_loaded.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Name three primary colors."}])
    ref = reference_logits(real_reference, ids + [504, 3418])
    run = Runner(real_loaded.model)
    n = len(ids)
    logits = run.step(prefill=[(torch.tensor(ids), 0, torch.arange(n), True)], all_logits=True)
    assert_close(logits, ref[:n], 5e-2)
    assert torch.equal(logits.argmax(-1), ref[:n].argmax(-1))
    run2 = Runner(real_loaded.model)  # prefix from one step, the rest after it
    run2.step(prefill=[(torch.tensor(ids[:20]), 0, torch.arange(20), False)])
    logits = run2.step(prefill=[(torch.tensor(ids[20:]), 20, torch.arange(n), True)])
    assert_close(logits[0], ref[n - 1], 5e-2)
    for pos, token in ((n, 504), (n + 1, 3418)):
        logits = run2.step(decode=[(token, pos, torch.arange(pos + 1))])
        assert_close(logits[0], ref[pos], 5e-2)
        assert logits[0].argmax() == ref[pos].argmax()


def test_native_row_kernels_match_the_pytorch_formulas():
    from radixserve.model import native
    from radixserve.model.llama import rotate_half

    ops = native.paged_ops()
    if ops is None:
        pytest.skip("the native kernels did not build on this machine")
    torch.manual_seed(0)
    rows, hidden, heads, dim = 37, 64, 3, 32  # rows over several threads' chunks
    x, w = torch.randn(rows, hidden) * 3, torch.rand(hidden) + 0.5
    expected = w * torch.nn.functional.rms_norm(x, (hidden,), eps=1e-5)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(rows, 2 * hidden) * 6  # large |gate|: the exp must not overflow
    gate, up = gate_up.chunk(2, dim=-1)
    silu = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(ops.silu_mul(gate_up), silu, rtol=1e-5, atol=1e-5)

    angles = torch.outer(torch.arange(100.0), torch.rand(dim // 2))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    qkv = torch.randn(rows, (heads + 1) * dim)  # two rotated heads, then one left alone
    positions = torch.randint(0, 100, (rows,))
    rotated = qkv.clone()
    ops.rope_(rotated, positions, cos, sin, 2, dim)
    v = qkv[:, : 2 * dim].view(rows, 2, dim)
    c, s = cos[positions][:, None], sin[positions][:, None]
    expected = (v * c + rotate_half(v) * s).reshape(rows, -1)
    torch.testing.assert_close(rotated[:, : 2 * dim], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(rotated[:, 2 * dim :], qkv[:, 2 * dim :])
    with pytest.raises(RuntimeError, match="position out of the RoPE table"):
        ops.rope_(qkv, torch.full((rows,), 100), cos, sin, 2, dim)


def test_native_argmax_gives_torchs_answer_ties_and_nan_included():
    from radixserve.engine.sampler import _argmax
    from radixserve.model import native

    ops = native.paged_ops()
    if ops is None:
        pytest.skip("the native kernels did not build on this machine")
    torch.manual_seed(0)
    for shape in [(16, 49152), (3, 13), (5, 1), (1, 8)]:  # vector body, tail, tail only
        x = torch.randn(*shape)
        assert torch.equal(ops.argmax(x), x.argmax(dim=-1)), shape
    x = torch.zeros(5, 100)
    x[0, 10:] = 1.0  # a tie: the first one wins
    x[1, 50], x[1, 70] = float("nan"), float("nan")  # NaN counts as the largest, first NaN wins
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 99] = float("inf")  # in the scalar tail
    x[4, 97] = float("nan")  # a NaN in the tail beats a larger number in the body
    x[4, 3] = 5.0
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [10, 50, 0, 99, 97]
    assert torch.equal(ops.argmax(x), expected)
    assert torch.equal(_argmax(x), expected)  # the sampler's greedy path takes the native one
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.argmax(torch.zeros(2, 0))
