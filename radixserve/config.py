"""EngineConfig: every engine option, frozen, in one group per feature, validated once.

``EngineConfig.from_options(**options)`` is the one builder: it takes the flat option names
(the CLI's flags without ``--``, e.g. ``page_size``, ``host_kv_memory``), rejects unknown ones,
resolves the defaults that depend on other options, and hands each group its fields; every
group checks its own values and ``EngineConfig`` the rules across groups, raising a
``ValueError`` that names the option. Nothing rewrites itself after construction.

The groups: ``cache`` (the device pool and the radix tree), ``scheduler``, ``kv_events``,
``tiers`` (the hierarchical cache), ``disagg`` (prefill/decode disaggregation),
``segments`` (RAG segments), ``links`` (the keys of the ZeroMQ sockets) and ``drafts``
(drafted tokens verified in one step). Readers use the nested name
(``config.cache.page_size``); the flat names are only the builder's input.

The KV pool is sized by ``max_total_tokens`` or ``kv_cache_memory`` (bytes, or a string such
as ``"2GiB"``); with neither, by a share of the device's free memory. The hierarchical cache
is off by default: ``host_kv_memory`` adds a host tier (L2) and ``kv_storage`` a storage tier
below it (L3; given alone, it brings a host tier sized by default, see
``engine/cache_setup.py``). ``kv_storage`` is a URL (``file:///path``, ``redis://host:port/db``)
or a plain directory path (a file store). Without an explicit ``write_policy``, pages are copied
to the host when the device evicts them (``write_back``: every page that would be lost, and no
others), or, with a storage tier, as soon as they are computed (``write_through``): a store is
for sharing and restarts, which need every computed page (docs/decisions.md says why).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.eviction import EVICTION_POLICIES, check_cache_threshold
from radixserve.cache.kv_format import KV_CACHE_DTYPES
from radixserve.cache.tier_controller import WRITE_POLICIES
from radixserve.config_checks import (
    check_choice,
    check_endpoint,
    check_float_layers,
    check_int,
    check_positive,
    parse_bytes,
)
from radixserve.links.keys import ZmqSecurity, load_security
from radixserve.model.quant import QUANTIZATIONS

__all__ = ["EngineConfig", "parse_bytes"]

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
DISAGGREGATION_MODES = ("off", "prefill", "decode")
DTYPES = ("auto", "float32", "bfloat16", "float16")


MAX_PIN_SHARE = 0.9  # the rest of the pool stays for running requests


def check_pin_share(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number in [0, {MAX_PIN_SHARE}], got {value!r}")
    if not 0 <= value <= MAX_PIN_SHARE:
        raise ValueError(
            f"{name} must be in [0, {MAX_PIN_SHARE}] (a share of the device pool), got {value!r}"
        )


@dataclass(frozen=True)
class CacheConfig:
    enable_prefix_caching: bool = True
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens
    kv_cache_memory: int | None = None  # KV pool size in bytes
    eviction_policy: str = "lru"
    # evict nodes reused less than this often (hits per admitted request) before all others
    cache_threshold: float | None = None
    # models with sliding-window layers: their KV in a pool of its own with slots for this
    # share of the main pool's, dropped where no request can read it (cache/window_tree.py);
    # 0: every layer's KV for every cached token, in one pool
    window_kv_share: float = 0.2
    # how the device pool stores KV: auto (the model's dtype) or int8 (codes with float16
    # scales per group of channels: cache/kv_format.py)
    kv_cache_dtype: str = "auto"
    # int8 KV: layers kept in the model's dtype: "auto" (by the model's key biases,
    # model/kv_layers.py), "none", or layer indices "0,1,8"
    kv_float_layers: str = "auto"
    # pins (cache/pins.py): at most this share of the device pool pinned, in all and per
    # tenant (None: the same as in all); 0: nothing is pinned
    pin_budget: float = 0.25
    pin_tenant_budget: float | None = None

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, 1)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_float_layers(self.kv_float_layers, self.kv_cache_dtype)
        check_pin_share("pin_budget", self.pin_budget)
        if self.pin_tenant_budget is not None:
            check_pin_share("pin_tenant_budget", self.pin_tenant_budget)
        check_choice("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        if self.cache_threshold is not None:
            check_cache_threshold(self.cache_threshold)
        if self.max_total_tokens is not None:
            check_int("max_total_tokens", self.max_total_tokens, self.page_size)
            if self.kv_cache_memory is not None:
                raise ValueError("give max_total_tokens or kv_cache_memory, not both")
        if self.kv_cache_memory is not None:
            check_int("kv_cache_memory", self.kv_cache_memory, 1)
        r = self.window_kv_share
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 <= r <= 1:
            raise ValueError(f"window_kv_share must be in [0, 1], got {r!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    # most prompt tokens computed in one step; None: 256 on CPU (a step of 16 decodes and 256
    # prompt tokens takes ~0.4 s there, so streams stall no longer), 2048 on GPUs
    chunked_prefill_size: int = 256
    max_running_requests: int = 64
    max_model_len: int | None = None  # context limit; default: the model's
    schedule_policy: str = "lpm"
    max_overtakes: int = 32  # a waiting request passed over this often goes first

    def __post_init__(self) -> None:
        for name in ("chunked_prefill_size", "max_running_requests", "max_overtakes"):
            check_int(name, getattr(self, name), 1)
        check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2)


DRAFT_SOURCES = ("grammar", "text", "cache")
# on by default only where a benchmark shows drafts never lose (docs/drafts.md): the grammar's
# forced text in batches of up to two; text and cache drafts are opt-in until measured
DEFAULT_DRAFT_SOURCES = ("grammar",)


@dataclass(frozen=True)
class DraftConfig:
    """Drafts (engine/drafts/, docs/drafts.md): tokens proposed for a request's next step
    and verified by the model in that step, from the sources named here, in this order of
    preference on ties (grammar: the text a grammar forces; text: the request's own prompt
    and output; cache: what the prefix cache holds of the same namespace)."""

    draft_sources: tuple[str, ...] = DEFAULT_DRAFT_SOURCES
    max_draft_tokens: int = 16  # most draft tokens verified in one step, per request
    # no drafts while more requests than this run (0: never)
    draft_max_batch: int = 2
    # a step's cost per row as a share of a one-row step's (what a draft row must pay for)
    draft_row_cost: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.draft_sources, tuple):
            raise ValueError(f"draft_sources must be a tuple of names, got {self.draft_sources!r}")
        for name in self.draft_sources:
            check_choice("draft_sources", name, DRAFT_SOURCES)
        if len(set(self.draft_sources)) != len(self.draft_sources):
            raise ValueError(f"draft_sources names a source twice: {self.draft_sources!r}")
        check_int("max_draft_tokens", self.max_draft_tokens, 1)
        check_int("draft_max_batch", self.draft_max_batch, 0)
        r = self.draft_row_cost
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 < r <= 1:
            raise ValueError(f"draft_row_cost must be in (0, 1], got {r!r}")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_events: bool = False  # from the start; a publisher switches them on and off
    kv_events_block_size: int | None = None  # tokens per event block; None: 16, in whole pages
    kv_events_endpoint: str | None = None  # the engine process publishes KV events here
    kv_events_replay_endpoint: str | None = None  # replay and dump requests

    def __post_init__(self) -> None:
        if self.kv_events_block_size is not None:
            check_int("kv_events_block_size", self.kv_events_block_size, 1)
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            check_endpoint(name, getattr(self, name), r"(tcp|ipc|inproc)://\S+",
                           "tcp://HOST:PORT or ipc://PATH")  # fmt: skip
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")


@dataclass(frozen=True)
class TierConfig:
    host_kv_memory: int | None = None  # host tier (L2) size in bytes; None: off
    write_policy: str | None = None  # one of WRITE_POLICIES; set exactly when there is a host
    kv_storage: str | None = None  # storage tier (L3): file:///path or redis://host:port/db
    kv_storage_size: int | None = None  # file storage cap in bytes; None: unbounded
    load_back_min_tokens: int = 16  # a shorter host hit is recomputed, not loaded
    storage_prefetch_min_tokens: int = 16  # a shorter storage hit is not fetched
    # storage keeps KV in blocks of this many tokens (rounded up to a page multiple), whatever
    # the page size: one file or key per block, not per page
    kv_storage_block_tokens: int = 64
    storage_prefetch_timeout: float = 2.0  # seconds a request waits for its pages, then computes
    # how the host and storage tiers store KV: auto (as the device pool) or int8 (a float
    # device pool's pages encoded as they leave it, decoded as they come back)
    kv_tier_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_choice("kv_tier_dtype", self.kv_tier_dtype, KV_CACHE_DTYPES)
        for name in ("host_kv_memory", "kv_storage_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        tiered = self.host_kv_memory is not None or self.kv_storage is not None
        if not tiered and self.write_policy is not None:
            raise ValueError("write_policy needs a host tier: give host_kv_memory or kv_storage")
        if tiered:
            check_choice("write_policy", self.write_policy, WRITE_POLICIES)
        if self.kv_storage_size is not None and self.kv_storage is None:
            raise ValueError("kv_storage_size needs kv_storage")
        if self.kv_storage is not None and not re.match(r"(file|redis)://", self.kv_storage):
            raise ValueError(
                f"kv_storage {self.kv_storage!r}: use file:///absolute/path or redis://host:port/db"
            )
        for name in ("load_back_min_tokens", "storage_prefetch_min_tokens"):
            check_int(name, getattr(self, name), 0)
        check_int("kv_storage_block_tokens", self.kv_storage_block_tokens, 1)
        check_positive("storage_prefetch_timeout", self.storage_prefetch_timeout)


@dataclass(frozen=True)
class DisaggConfig:
    disaggregation_mode: str = "off"  # or this instance's role: prefill, decode
    kv_transfer_host: str = "127.0.0.1"  # prefill: where decode instances connect
    kv_transfer_port: int = 0  # prefill: 0 = any free port (reported by /disagg/info)
    kv_transfer_data_port: int = 0  # prefill, with keys: the sealed KV connection's; 0 = any
    kv_transfer_heartbeat: float = 1.0  # seconds; a peer silent for 5 of them is dead
    prefill_endpoint: str | None = None  # decode: the prefill instance when a request names none
    kv_transfer_timeout: float = 30.0  # decode: then the prompt is computed here instead
    # decode: prompts with fewer uncached tokens are prefilled here (docs/benchmarks.md)
    remote_prefill_min_tokens: int = 64

    def __post_init__(self) -> None:
        check_choice("disaggregation_mode", self.disaggregation_mode, DISAGGREGATION_MODES)
        for name in ("kv_transfer_port", "kv_transfer_data_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")
        for name in ("kv_transfer_heartbeat", "kv_transfer_timeout"):
            check_positive(name, getattr(self, name))
        check_int("remote_prefill_min_tokens", self.remote_prefill_min_tokens, 1)
        if self.prefill_endpoint is not None:
            if self.disaggregation_mode != "decode":
                raise ValueError("prefill_endpoint is for disaggregation_mode decode")
            check_endpoint("prefill_endpoint", self.prefill_endpoint, r"tcp://\S+",
                           "tcp://HOST:PORT")  # fmt: skip


@dataclass(frozen=True)
class SegmentConfig:
    """RAG segments (engine/segments.py): the share of reused segment tokens computed again,
    how many leading tokens of each segment go first, the layer whose K/V deviation ranks the
    rest, and how many of the prompt's first tokens a segment's stored K/V is computed after
    (up to the first segment; 0: standalone from position 0)."""

    segment_recompute_ratio: float = 0.15
    segment_first_tokens: int = 4
    segment_deviation_layer: int = 1
    segment_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        r = self.segment_recompute_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 <= r <= 1:
            raise ValueError(f"segment_recompute_ratio must be in [0, 1], got {r!r}")
        check_int("segment_first_tokens", self.segment_first_tokens, 0)
        check_int("segment_deviation_layer", self.segment_deviation_layer, 1)
        check_int("segment_prefix_tokens", self.segment_prefix_tokens, 0)


@dataclass(frozen=True)
class LinkConfig:
    """Who may use the engine's ZeroMQ sockets (KV events, KV transfer; ``links/keys.py``):
    CurveZMQ with this process's key pair (``zmq_key``: a secret key file; None:
    ``$RADIXSERVE_ZMQ_KEY``, else the user's default key file), accepting clients with that
    key or one of ``zmq_allow`` (keys, key files, directories); or, only when
    ``zmq_unauthenticated``, plain sockets that admit anyone."""

    zmq_key: str | None = None
    zmq_allow: tuple[str, ...] = ()
    zmq_unauthenticated: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "zmq_allow", tuple(self.zmq_allow or ()))
        if self.zmq_unauthenticated and (self.zmq_key or self.zmq_allow):
            raise ValueError("zmq_unauthenticated takes no zmq_key or zmq_allow")

    def security(self) -> ZmqSecurity:
        """The keys, read now (``LinkKeyError``, a ValueError, names what is wrong)."""
        return load_security(self.zmq_key, self.zmq_allow, self.zmq_unauthenticated)


GROUPS = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "kv_events": KVEventsConfig,
    "tiers": TierConfig,
    "disagg": DisaggConfig,
    "segments": SegmentConfig,
    "links": LinkConfig,
    "drafts": DraftConfig,
}
# flat option name -> its group (every option name is unique across the groups)
OPTION_GROUP = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # .gguf file or HF directory; None: SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # bfloat16 where the hardware has it natively, else float32
    # weights kept quantized: auto (a GGUF file's own Q8_0/Q4_0/Q4_1 blocks), none, int8, int4
    quantization: str = "auto"
    seed: int = 0  # seeds requests that give no seed of their own
    # serve: the engine process appends every step and admission, timed, to this file as JSON
    # lines (engine/step_trace.py; what `simulate fit --server` measures); None: off
    step_trace: str | None = None
    load_progress: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    segments: SegmentConfig = field(default_factory=SegmentConfig)
    links: LinkConfig = field(default_factory=LinkConfig)
    drafts: DraftConfig = field(default_factory=DraftConfig)

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        size, page = self.kv_events.kv_events_block_size, self.cache.page_size
        if size is not None and size % page:
            raise ValueError(
                f"kv_events_block_size must be a positive multiple of page_size ({page}), "
                f"got {size!r}"
            )
        tiered = self.tiers.host_kv_memory is not None or self.tiers.kv_storage is not None
        if tiered and not self.cache.enable_prefix_caching:
            raise ValueError("host_kv_memory and kv_storage need the prefix cache (it is disabled)")
        if self.tiers.kv_tier_dtype != "auto" and not tiered:
            raise ValueError("kv_tier_dtype needs a host tier: give host_kv_memory or kv_storage")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """The config from flat option names; unknown names and bad values are a ValueError
        naming the option."""
        top = {f.name for f in dataclasses.fields(cls) if f.name not in GROUPS}
        unknown = sorted(set(options) - top - set(OPTION_GROUP))
        if unknown:
            known = sorted(top | set(OPTION_GROUP))
            raise ValueError(
                f"unknown engine option(s) {', '.join(unknown)}; valid options: {', '.join(known)}"
            )
        options = resolve_defaults(options)
        grouped: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        for name, value in options.items():
            if name in OPTION_GROUP:
                grouped[OPTION_GROUP[name]][name] = value
        top_level = {k: v for k, v in options.items() if k in top}
        return cls(**top_level, **{g: GROUPS[g](**kw) for g, kw in grouped.items()})

    def options(self) -> dict[str, Any]:
        """Every option by its flat name (``from_options(**c.options()) == c``)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for group in GROUPS:
            flat.update(dataclasses.asdict(flat.pop(group)))
        return flat

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some options (flat names) changed, validated like a new config."""
        return EngineConfig.from_options(**{**self.options(), **changes})


def resolve_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """The options with sizes in bytes and the defaults that depend on other options filled."""
    out = dict(options)
    for name in ("kv_cache_memory", "host_kv_memory", "kv_storage_size"):
        if out.get(name) is not None:
            out[name] = parse_bytes(out[name], name)
    if out.get("chunked_prefill_size") is None:
        out["chunked_prefill_size"] = (
            256 if str(out.get("device", "cpu")).startswith("cpu") else 2048
        )
    if out.get("kv_storage") is not None:
        out["kv_storage"] = storage_url(out["kv_storage"])
    if isinstance(out.get("draft_sources"), str | list):
        out["draft_sources"] = draft_sources(out["draft_sources"])
    tiered = out.get("host_kv_memory") is not None or out.get("kv_storage") is not None
    if out.get("write_policy") is None and tiered:
        out["write_policy"] = "write_through" if out.get("kv_storage") else "write_back"
    return out


def draft_sources(value: str | list[str]) -> tuple[str, ...]:
    """``draft_sources`` as a tuple: a comma-separated string (``"text,cache"``; ``"none"`` or
    an empty string for none) or a list of names."""
    if isinstance(value, str):
        value = [] if value.strip() in ("", "none") else value.split(",")
    return tuple(v.strip() for v in value)


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
