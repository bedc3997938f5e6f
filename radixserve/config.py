"""EngineConfig: every engine option in one validated dataclass.

Unknown options are an error (``EngineConfig.from_options``), never silently dropped. The KV
pool is sized by ``max_total_tokens`` or ``kv_cache_memory`` (bytes, or a string such as
``"2GiB"``); with neither, by a share of the device's free memory.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from radixserve.cache.eviction import EVICTION_POLICIES

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
DTYPES = ("auto", "float32", "bfloat16", "float16")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 10**3,
    "kib": 2**10,
    "m": 2**20,
    "mb": 10**6,
    "mib": 2**20,
    "g": 2**30,
    "gb": 10**9,
    "gib": 2**30,
}


def parse_bytes(value: int | str) -> int:
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a memory size (examples: 2GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    model: str | None = None  # .gguf file or HF directory; None: SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # bfloat16 where the hardware has it natively, else float32
    enable_prefix_caching: bool = True
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens
    kv_cache_memory: int | str | None = None  # KV pool size in bytes ("4GiB")
    # most prompt tokens computed in one step; None: 256 on CPU (a step of 16 decodes and 256
    # prompt tokens takes ~0.4 s there, so streams stall no longer), 2048 on GPUs
    chunked_prefill_size: int | None = None
    max_running_requests: int = 64
    max_model_len: int | None = None  # context limit; default: the model's
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    max_overtakes: int = 32  # a waiting request passed over this often goes first (no starvation)
    enable_kv_events: bool = False
    seed: int = 0  # seeds requests that give no seed of their own
    load_progress: bool = True
    # RAG segments (engine/segments.py): share of reused segment tokens computed again, how
    # many leading tokens of each segment go first, and the layer whose K/V deviation ranks
    # the rest
    segment_recompute_ratio: float = 0.15
    segment_first_tokens: int = 4
    segment_deviation_layer: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"unknown schedule_policy {self.schedule_policy!r}; "
                f"choose one of {SCHEDULE_POLICIES}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction_policy {self.eviction_policy!r}; "
                f"choose one of {tuple(EVICTION_POLICIES)}"
            )
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 256 if self.device.startswith("cpu") else 2048
        for name in ("page_size", "chunked_prefill_size", "max_running_requests", "max_overtakes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must hold at least one page ({self.page_size})")
        if self.max_total_tokens is not None and self.kv_cache_memory is not None:
            raise ValueError("give max_total_tokens or kv_cache_memory, not both")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ValueError("kv_cache_memory must be positive")
        r = self.segment_recompute_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 <= r <= 1:
            raise ValueError(f"segment_recompute_ratio must be in [0, 1], got {r!r}")
        for name, low in (("segment_first_tokens", 0), ("segment_deviation_layer", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {', '.join(unknown)}; "
                f"valid options: {', '.join(sorted(known))}"
            )
        return cls(**options)
