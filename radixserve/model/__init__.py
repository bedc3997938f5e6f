"""Model loading (GGUF, HF safetensors), the Llama-family forward, attention over slots."""

from radixserve.model.attention import build_forward_batch
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaModel
from radixserve.model.loader import LoadedModel, ModelNotFoundError, load_model
from radixserve.model.tokenizer import Tokenizer

__all__ = [
    "ForwardBatch",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelNotFoundError",
    "Tokenizer",
    "build_forward_batch",
    "load_model",
]
