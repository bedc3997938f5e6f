"""The options shared by the ``radixserve`` commands: every engine option as a flag, and the
sampling flags.

``add_engine_args`` adds one flag per ``ENGINE_FLAGS`` entry and ``engine_config_from_args``
builds the ``EngineConfig`` from them in one place; a bad value ends with an argparse error
naming the flag the user typed. The root CLI and every sub-command's CLI import this module,
never each other.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from radixserve.cache.eviction import EVICTION_POLICIES
from radixserve.cache.kv_format import KV_CACHE_DTYPES
from radixserve.cache.tier_controller import WRITE_POLICIES
from radixserve.config import (
    DEFAULT_DRAFT_SOURCES,
    DISAGGREGATION_MODES,
    DTYPES,
    SCHEDULE_POLICIES,
    EngineConfig,
    TierConfig,
)
from radixserve.model.quant import QUANTIZATIONS

ENGINE_FLAGS = {
    # option: (flag kwargs)
    "model": dict(
        help="a .gguf file, a Hugging Face model directory, or a known model's name "
        "(`radixserve pull` lists them; default: smollm2-135m)"
    ),
    "device": dict(default="cpu", help="torch device (cpu, cuda, cuda:1); default %(default)s"),
    "dtype": dict(
        default="auto",
        choices=DTYPES,
        help="weights and KV dtype; auto: bfloat16 on hardware that computes it natively "
        "(AVX512-BF16, AMX, recent GPUs), else float32; float32 on a CPU for a GGUF file kept "
        "in its Q5 / K-quant blocks",
    ),
    "quantization": dict(
        default="auto",
        choices=QUANTIZATIONS,
        help="weights kept quantized and computed as such: auto (a GGUF file's own Q8_0, "
        "Q4_0, Q4_1 tensors; a Hugging Face model loads dense), none (dequantize all), "
        "int8, int4; default %(default)s",
    ),
    "chunked_prefill_size": dict(
        type=int, help="most prompt tokens computed per step (default: 256 on CPU, 2048 on GPU)"
    ),
    "max_total_tokens": dict(type=int, help="KV pool size in tokens"),
    "kv_cache_memory": dict(
        help="KV pool size in bytes, e.g. 2GiB (default: 25%% of free RAM, "
        "at most 4GiB; 60%% of free GPU memory)"
    ),
    "page_size": dict(type=int, default=1, help="tokens per KV page; default %(default)s"),
    "kv_cache_dtype": dict(
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="how the KV cache stores keys and values: auto (the model's dtype) or int8 (one "
        "byte per value and a float16 scale per 16 channels of a token's head: 3.6x the "
        "tokens of float32 in the same memory, less for layers --kv-float-layers keeps in "
        "float); default %(default)s",
    ),
    "kv_float_layers": dict(
        default="auto",
        help="with --kv-cache-dtype int8, layers whose KV stays in the model's dtype: auto "
        "(layers whose key bias is over 10x the median layer's, e.g. Qwen2.5's first ones), "
        "none, or indices such as 0,1,8; default %(default)s",
    ),
    "schedule_policy": dict(
        default="lpm", choices=SCHEDULE_POLICIES, help="waiting-queue order; default %(default)s"
    ),
    "eviction_policy": dict(
        default="lru",
        choices=sorted(EVICTION_POLICIES),
        help="radix-tree eviction order; default %(default)s",
    ),
    "cache_threshold": dict(
        type=float,
        help="evict nodes whose reuse rate (hits per request admitted since they were cached) "
        "is below this, before any other (0.1-0.3 is the usual range); default: off",
    ),
    "window_kv_share": dict(
        type=float,
        default=0.2,
        help="models with sliding-window layers (Gemma 3): their KV is kept for this share of "
        "the cached tokens only, the rest dropped where no request can read it (0: keep every "
        "layer's KV for every cached token); default %(default)s",
    ),
    "pin_budget": dict(
        type=float,
        default=0.25,
        help="share of the device KV pool that pinned prefixes may hold (cache_control, "
        "cache_pin, /admin/pins; docs/caching.md), at most 0.9; 0: no pins; default %(default)s",
    ),
    "pin_tenant_budget": dict(
        type=float,
        help="share of the device KV pool one tenant's pins may hold; default: --pin-budget",
    ),
    "max_running_requests": dict(
        type=int, default=64, help="most requests decoding at once; default %(default)s"
    ),
    "max_model_len": dict(type=int, help="context limit (default: the model's)"),
    # drafts (docs/drafts.md)
    "draft_sources": dict(
        default=",".join(DEFAULT_DRAFT_SOURCES),
        help="where drafts of a request's next tokens come from, verified by the model in one "
        "step: a comma-separated list of grammar (the text a grammar forces), text (the "
        "request's own prompt and output), cache (the prefix cache's text of the same "
        "namespace), or none; default %(default)s",
    ),
    "max_draft_tokens": dict(
        type=int, default=16, help="most draft tokens verified in one step; default %(default)s"
    ),
    "draft_max_batch": dict(
        type=int,
        default=2,
        help="no drafts while more requests than this run (0: never); default %(default)s",
    ),
    "draft_row_cost": dict(
        type=float,
        default=0.1,
        help="what one more row adds to a step, as a share of a one-row step: a draft token "
        "is verified only if the chance it is kept pays for its row; default %(default)s",
    ),
    "seed": dict(type=int, default=0, help="seed for requests that set none; default %(default)s"),
    # RAG segments (docs/rag-segments.md)
    "segment_recompute_ratio": dict(
        type=float,
        default=0.15,
        help="share of the reused tokens of RAG segments computed again (0: pure reuse, "
        "1: a full prefill); default %(default)s",
    ),
    "segment_first_tokens": dict(
        type=int,
        default=4,
        help="leading tokens of each reused segment recomputed first; default %(default)s",
    ),
    "segment_deviation_layer": dict(
        type=int,
        default=1,
        help="layer whose K/V deviation picks the other recomputed tokens; default %(default)s",
    ),
    "segment_prefix_tokens": dict(
        type=int,
        default=0,
        help="RAG segments are stored computed after this many of the prompt's first tokens "
        "(the shared system prompt; at most up to the first segment), so their K/V saw the "
        "prompt's real start; 0: standalone; default %(default)s",
    ),
    # the hierarchical cache (docs/caching.md)
    "host_kv_memory": dict(
        help="host KV tier (L2) size, e.g. 8GiB, larger than the device pool: what the device "
        "evicts is kept there and loaded back on a hit; default: no host tier"
    ),
    "write_policy": dict(
        choices=WRITE_POLICIES,
        help="when KV is copied to the host tier: once reused (write_through_selective), as "
        "soon as computed (write_through) or when evicted (write_back); default "
        "write_back, or write_through with --kv-storage",
    ),
    "kv_storage": dict(
        help="storage tier (L3) below the host tier, shared by restarts and instances: a "
        "directory, file:///absolute/path or redis://host:port/db; alone, it brings a host tier "
        "sized from the device pool and free memory (logged at start-up)"
    ),
    "kv_storage_size": dict(help="file storage size cap, e.g. 50GiB (LRU); default unbounded"),
    "load_back_min_tokens": dict(
        type=int,
        default=TierConfig.load_back_min_tokens,
        help="a shorter host-tier hit is recomputed instead of loaded; default %(default)s",
    ),
    "kv_storage_block_tokens": dict(
        type=int,
        default=TierConfig.kv_storage_block_tokens,
        help="the storage tier keeps KV in blocks of this many tokens (rounded up to a page "
        "multiple): one file or key per block, whatever the page size; default %(default)s",
    ),
    "storage_prefetch_min_tokens": dict(
        type=int,
        default=TierConfig.storage_prefetch_min_tokens,
        help="a shorter storage hit is not fetched; default %(default)s",
    ),
    "storage_prefetch_timeout": dict(
        type=float,
        default=TierConfig.storage_prefetch_timeout,
        help="seconds a request waits for pages from storage before computing them; "
        "default %(default)s",
    ),
    "kv_tier_dtype": dict(
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="how the host and storage tiers store KV: auto (as the device pool) or int8 (a "
        "float device pool's pages encoded to int8 as they leave it: 3.6x the tokens per "
        "byte of host memory and storage); default %(default)s",
    ),
    # prefill/decode disaggregation (docs/fleet.md)
    "disaggregation_mode": dict(
        default="off",
        choices=DISAGGREGATION_MODES,
        help="off (default), or this instance's role: prefill (computes prompts' KV and sends "
        "it to decode instances) or decode (takes prompts' KV from a prefill instance)",
    ),
    "kv_transfer_host": dict(
        default="127.0.0.1",
        help="prefill mode: address of the KV transfer socket; default %(default)s",
    ),
    "kv_transfer_port": dict(
        type=int, default=0, help="prefill mode: port of the KV transfer socket (0: any free)"
    ),
    "kv_transfer_data_port": dict(
        type=int,
        default=0,
        help="prefill mode with ZeroMQ keys: port of the connection the KV itself goes over, "
        "sealed with AES-256-GCM (0: any free; decode instances learn it in the handshake)",
    ),
    "kv_transfer_heartbeat": dict(
        type=float,
        default=1.0,
        help="seconds between heartbeats; a peer silent for 5 is dead; default %(default)s",
    ),
    "prefill_endpoint": dict(
        help="decode mode: the prefill instance's KV endpoint (tcp://HOST:PORT, from its "
        "/disagg/info) for requests that name none (the router names one per request)"
    ),
    "kv_transfer_timeout": dict(
        type=float,
        default=30.0,
        help="decode mode: seconds a transfer may take before the prompt is computed here "
        "instead; default %(default)s",
    ),
    "remote_prefill_min_tokens": dict(
        type=int,
        default=64,
        help="decode mode: prompts with fewer uncached tokens are prefilled here; "
        "default %(default)s",
    ),
}
ALIASES = {"host_kv_memory": ("--hicache-size",)}  # SGLang's name for the same option


def flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    for option, kwargs in ENGINE_FLAGS.items():
        group.add_argument(flag(option), *ALIASES.get(option, ()), dest=option, **kwargs)
    group.add_argument(
        "--disable-prefix-caching",
        action="store_true",
        help="run without the radix cache (the baseline)",
    )


def engine_config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, **extra: Any
) -> EngineConfig:
    options = {k: getattr(args, k) for k in ENGINE_FLAGS}
    options["enable_prefix_caching"] = not args.disable_prefix_caching
    try:
        return EngineConfig.from_options(**options, **extra)
    except ValueError as e:
        message = str(e)
        for option in [*ENGINE_FLAGS, *extra]:  # name the flag the user typed, not the field
            message = message.replace(option, flag(option))
        parser.error(message)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group(
        "sampling (unset: the model's recommended defaults, else the API's)"
    )
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    group.add_argument("--sample-seed", type=int, default=None, help="seed for sampling")


def sampling_params_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, config):
    """The flags given, over the model's recommended defaults (``generation_defaults``)."""
    from radixserve.engine import SamplingParams
    from radixserve.model.generation_defaults import generation_defaults
    from radixserve.model.loader import ModelNotFoundError, resolve_model_path

    try:
        defaults = generation_defaults(resolve_model_path(config.model))
    except ModelNotFoundError as e:
        parser.error(str(e))
    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.sample_seed,
    }
    fields = {**defaults.values, **{k: v for k, v in given.items() if v is not None}}
    print(f"sampling: {', '.join(f'{k}={v}' for k, v in sorted(fields.items()))} "
          f"(defaults {defaults.describe()})", file=sys.stderr)  # fmt: skip
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        message = str(e)
        for name in ("max_tokens", "top_p", "top_k", "temperature"):
            message = message.replace(name, "--" + name.replace("_", "-"))
        parser.error(message)
