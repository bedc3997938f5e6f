"""Read a Hugging Face model directory: ``config.json`` and ``*.safetensors`` weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from radixserve.model.config import ModelConfig


def load_hf_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face model directory?")
    config = ModelConfig.from_hf_dict(json.loads(config_file.read_text()), name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc=f"loading {path.name}", disable=not progress):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(dtype)
    return config, weights
