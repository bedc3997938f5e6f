"""The forward pass on CUDA equals the CPU's: dense and quantized weights, prefill and decode.

Skipped without a GPU; ``scripts/gpu_check.sh`` runs it on a machine that has one. On CUDA the
native CPU kernels never run: quantized weights dequantize with PyTorch ops, attention is the
PyTorch path.
"""

from __future__ import annotations

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.cache import KVPool
from radixserve.model import build_forward_batch, load_model
from radixserve.model.llama import LlamaModel
from radixserve.model.quant import QuantizedWeight, quantize_dense

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = [17, 934, 2210, 77, 5, 9001, 312, 48, 1200, 6, 815, 40000]


def steps(model: LlamaModel) -> torch.Tensor:
    pool = KVPool(model.kv_shape(), 64, model.device)
    n = len(PROMPT)
    first = build_forward_batch([], [(torch.tensor(PROMPT), 0, torch.arange(n), True)],
                                model.device, pool.pad_slot)  # fmt: skip
    out = [model.forward(first, pool).cpu()]
    token = int(out[0].argmax())
    for pos in range(n, n + 3):
        batch = build_forward_batch([(token, pos, torch.arange(pos + 1))], [], model.device,
                                    pool.pad_slot)  # fmt: skip
        out.append(model.forward(batch, pool).cpu())
        token = int(out[-1].argmax())
    return torch.cat(out)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_cuda_forward_equals_cpu(tiny_model_dir, quantization):
    from radixserve.model.hf_loader import load_hf_dir

    config, dense = load_hf_dir(tiny_model_dir, torch.float32, progress=False)
    weights = quantize_dense(dense, quantization)
    cpu = LlamaModel(config, weights, device="cpu")
    gpu = LlamaModel(config, weights, device="cuda")
    if quantization != "none":
        assert isinstance(gpu.layers[0]["qkv"], QuantizedWeight)
        assert gpu.layers[0]["qkv"].device.type == "cuda"
    assert (steps(gpu) - steps(cpu)).abs().max() < 1e-3


def test_engine_generates_on_cuda(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), device="cuda", dtype="float32", progress=False)
    llm = LLM(str(tiny_model_dir), loaded=loaded, device="cuda", max_total_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT[:5]], params)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    cpu = LLM(str(tiny_model_dir), dtype="float32", max_total_tokens=512).generate(PROMPT, params)
    assert outs[0].token_ids == cpu[0].token_ids
