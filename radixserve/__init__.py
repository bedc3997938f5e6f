"""radixserve: a prefix-reusing LLM serving engine with a global radix-tree KV cache."""

from radixserve.config import EngineConfig
from radixserve.engine import LLM, Engine, RequestOutput, SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
