"""EngineConfig: every engine option in one validated dataclass.

Unknown options are an error (``EngineConfig.from_options``), never silently dropped. The KV
pool is sized by ``max_total_tokens`` or ``kv_cache_memory`` (bytes, or a string such as
``"2GiB"``); with neither, by a share of the device's free memory.

The hierarchical cache is off by default (exactly the single-tier cache): ``host_kv_memory``
adds a host tier (L2) and ``kv_storage`` a storage tier below it (L3; given alone, it brings a
host tier sized by default, see ``engine/cache_setup.py``). ``kv_storage`` is a URL
(``file:///path``, ``redis://host:port/db``) or a plain directory path (a file store). Without
an explicit ``write_policy``, pages are copied to the host when the device evicts them
(``write_back``: every page that would be lost, and no others), or, with a storage tier, as
soon as they are computed (``write_through``): a store is for sharing and restarts, which need
every computed page (docs/decisions.md says why).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from radixserve.cache.eviction import EVICTION_POLICIES, check_cache_threshold
from radixserve.cache.tiered_cache import WRITE_POLICIES
from radixserve.model.quant import QUANTIZATIONS

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
DISAGGREGATION_MODES = ("off", "prefill", "decode")
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
    # weights kept quantized: auto (a GGUF file's own Q8_0/Q4_0/Q4_1 blocks), none, int8, int4
    quantization: str = "auto"
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
    # evict nodes reused less than this often (hits per admitted request) before all others
    cache_threshold: float | None = None
    max_overtakes: int = 32  # a waiting request passed over this often goes first (no starvation)
    enable_kv_events: bool = False  # from the start; a publisher switches them on and off
    kv_events_block_size: int | None = None  # tokens per event block; None: 16, in whole pages
    kv_events_endpoint: str | None = None  # the engine process publishes KV events here
    kv_events_replay_endpoint: str | None = None  # replay and dump requests
    # hierarchical cache (see the module docstring)
    host_kv_memory: int | str | None = None  # host tier (L2) size in bytes ("8GiB"); None: off
    write_policy: str | None = None  # one of WRITE_POLICIES; None: chosen as described above
    kv_storage: str | None = None  # storage tier (L3): file:///path or redis://host:port/db
    kv_storage_size: int | str | None = None  # file storage cap in bytes; None: unbounded
    load_back_min_tokens: int = 16  # a shorter host hit is recomputed, not loaded
    storage_prefetch_min_tokens: int = 16  # a shorter storage hit is not fetched
    # storage keeps KV in blocks of this many tokens (rounded up to a page multiple), whatever
    # the page size: one file or key per block, not per page
    kv_storage_block_tokens: int = 64
    storage_prefetch_timeout: float = 2.0  # seconds a request waits for its pages, then computes
    seed: int = 0  # seeds requests that give no seed of their own
    # serve: the engine process appends every step and admission, timed, to this file as JSON
    # lines (engine/step_trace.py; what `simulate fit --server` measures); None: off
    step_trace: str | None = None
    load_progress: bool = True
    # Prefill/decode disaggregation (radixserve/disagg): off, or this instance's role.
    disaggregation_mode: str = "off"
    kv_transfer_host: str = "127.0.0.1"  # prefill: where decode instances connect
    kv_transfer_port: int = 0  # prefill: 0 = any free port (reported by /disagg/info)
    kv_transfer_heartbeat: float = 1.0  # seconds; a peer silent for 5 of them is dead
    prefill_endpoint: str | None = None  # decode: the prefill instance when a request names none
    kv_transfer_timeout: float = 30.0  # decode: then the prompt is computed here instead
    # decode: prompts with fewer uncached tokens are prefilled here (see docs/BENCHMARKS.md)
    remote_prefill_min_tokens: int = 64
    # RAG segments (engine/segments.py): share of reused segment tokens computed again, how
    # many leading tokens of each segment go first, and the layer whose K/V deviation ranks
    # the rest; and how many of the prompt's first tokens a segment's stored K/V is computed
    # after (up to the first segment; 0: standalone from position 0)
    segment_recompute_ratio: float = 0.15
    segment_first_tokens: int = 4
    segment_deviation_layer: int = 1
    segment_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
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
        if self.cache_threshold is not None:
            check_cache_threshold(self.cache_threshold)
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
        segment_ints = (("segment_first_tokens", 0), ("segment_deviation_layer", 1),
                        ("segment_prefix_tokens", 0))  # fmt: skip
        for name, low in segment_ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        self._check_tiers()
        self._check_kv_events()
        self._check_disaggregation()

    def _check_tiers(self) -> None:
        for name in ("host_kv_memory", "kv_storage_size"):
            if getattr(self, name) is not None:
                setattr(self, name, parse_bytes(getattr(self, name)))
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name} must be positive")
        tiered = self.host_kv_memory is not None or self.kv_storage is not None
        if not tiered and self.write_policy is not None:
            raise ValueError("write_policy needs a host tier: give host_kv_memory or kv_storage")
        if tiered and not self.enable_prefix_caching:
            raise ValueError("host_kv_memory and kv_storage need the prefix cache (it is disabled)")
        if self.kv_storage_size is not None and self.kv_storage is None:
            raise ValueError("kv_storage_size needs kv_storage")
        if self.kv_storage is not None:
            self.kv_storage = storage_url(self.kv_storage)
        if self.write_policy is None and tiered:
            self.write_policy = "write_through" if self.kv_storage else "write_back"
        if self.write_policy is not None and self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"unknown write_policy {self.write_policy!r}; choose one of {WRITE_POLICIES}"
            )
        if not isinstance(self.kv_storage_block_tokens, int) or self.kv_storage_block_tokens < 1:
            raise ValueError("kv_storage_block_tokens must be a positive integer")
        for name in ("load_back_min_tokens", "storage_prefetch_min_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer")
        if not self.storage_prefetch_timeout > 0:
            raise ValueError("storage_prefetch_timeout must be positive (seconds)")

    def _check_kv_events(self) -> None:
        size = self.kv_events_block_size
        if size is not None and (not isinstance(size, int) or size < 1 or size % self.page_size):
            raise ValueError(
                f"kv_events_block_size must be a positive multiple of page_size "
                f"({self.page_size}), got {size!r}"
            )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"(tcp|ipc|inproc)://\S+", value):
                raise ValueError(
                    f"{name} must look like tcp://HOST:PORT or ipc://PATH, got {value!r}"
                )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")

    def _check_disaggregation(self) -> None:
        mode = self.disaggregation_mode
        if mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"unknown disaggregation_mode {mode!r}; choose one of {DISAGGREGATION_MODES}"
            )
        if not 0 <= self.kv_transfer_port <= 65535:
            raise ValueError(f"kv_transfer_port must be in 0..65535, got {self.kv_transfer_port}")
        for name in ("kv_transfer_heartbeat", "kv_transfer_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.remote_prefill_min_tokens < 1:
            raise ValueError("remote_prefill_min_tokens must be at least 1")
        if self.prefill_endpoint is not None:
            if mode != "decode":
                raise ValueError("prefill_endpoint is for disaggregation_mode decode")
            if not self.prefill_endpoint.startswith("tcp://"):
                got = self.prefill_endpoint
                raise ValueError(f"prefill_endpoint must look like tcp://HOST:PORT, got {got!r}")

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


def storage_url(value: str) -> str:
    """A ``kv_storage`` value as a URL: ``file://`` and ``redis://`` URLs as they are, a plain
    path (no scheme) as the file store in that directory."""
    if re.match(r"(file|redis)://", value):
        return value
    if "://" in value or not value.strip():
        raise ValueError(
            f"kv_storage {value!r}: use file:///absolute/path or redis://host:port/db, or a "
            "plain directory path"
        )
    return "file://" + os.path.abspath(os.path.expanduser(value))
