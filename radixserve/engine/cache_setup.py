"""Building the engine's KV pool, prefix cache and lower tiers from its config: none, one
tier, or the hierarchy.

- a model with sliding-window layers keeps their KV in a pool of its own, sized by
  ``window_kv_share`` (``window_pages.py``, ``window_tree.py``), unless a feature that moves
  every layer's KV of a slot is on (``window_share``);

- ``enable_prefix_caching=False``: ``NullCache`` (the A/B baseline), no lower tiers;
- by default: ``RadixCache`` over the device pool, no lower tiers (``NO_TIERS``);
- ``host_kv_memory``: the tree and a ``TierController`` below it with a host pool of that
  size (which must hold more than the device pool: the host tier keeps what the device
  evicts), and with ``kv_storage`` a storage tier below that, scoped by the model's identity
  so instances of the same weights (and only those) share pages;
- ``kv_storage`` alone: the same, with a host pool sized by ``utils.default_host_kv_bytes``
  (from the device pool and the free RAM), logged at start-up;
- ``pin_budget`` above 0 (and the radix tree): a ``PinTable`` over the tree
  (``cache/pins.py``), its budgets shares of the device pool.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from radixserve.cache import (
    NO_TIERS,
    KVEventQueue,
    KVPool,
    LowerTiers,
    NullCache,
    PagedAllocator,
    PrefixCache,
    RadixCache,
)
from radixserve.cache.eviction_base import EvictionPolicy
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.kv_pool import KVShape
from radixserve.cache.pins import PinTable
from radixserve.cache.tier_controller import TierController
from radixserve.cache.window_pages import WindowedAllocator
from radixserve.config import EngineConfig
from radixserve.utils import default_host_kv_bytes

log = logging.getLogger("radixserve")
SAMPLE_BYTES = 1 << 20


def build_pool(config: EngineConfig, shape: KVShape, num_slots: int, window: int,
               share: float) -> tuple[PagedAllocator, KVPool]:  # fmt: skip
    """The device pool and its allocator (``build_allocator``)."""
    allocator = build_allocator(config, num_slots, window, share)
    if not allocator.windowed:
        return allocator, KVPool(shape, allocator.num_slots, config.device)
    log.info("window layers: %d of %d, their KV for %d of %d tokens (window %d)",
             len(shape.window_layers), shape.num_layers, allocator.window_slots,
             allocator.num_slots, window)  # fmt: skip
    pool = KVPool(shape, allocator.num_slots, config.device, allocator.window_map,
                  allocator.window_slots)  # fmt: skip
    return allocator, pool


def build_allocator(config: EngineConfig, num_slots: int, window: int,
                    share: float) -> PagedAllocator:  # fmt: skip
    """The device pool's allocator: a ``WindowedAllocator`` (window pages for ``share`` of
    the slots, from ``window_share``; ``window``: the model's sliding window in tokens), or
    a ``PagedAllocator`` where ``share`` is 0 (the server's and the simulator's)."""
    page = config.cache.page_size
    if not share:
        return PagedAllocator(num_slots, page)
    window_slots = max(int(num_slots * share) // page * page, page)
    return WindowedAllocator(num_slots, page, window_slots, window)


def window_share(config: EngineConfig, shape: KVShape) -> float:
    """The share of the slots whose sliding-window layers' KV is kept, in a pool of its own
    (``window_kv_share``); 0: one pool for every layer. One pool without window layers or
    with the prefix cache off (nothing would be dropped), and with disaggregation or a GPU's
    host tier (a storage tier brings one), which move every layer's KV of a slot whole (at
    the memory cost of all layers)."""
    if not shape.window_layers or not config.cache.window_kv_share:
        return 0.0
    gpu = torch.device(config.device).type != "cpu"
    others = [name for name, on in (
        ("the host tier on a GPU", gpu and is_tiered(config)),
        ("disaggregation", config.disagg.disaggregation_mode != "off"),
    ) if on]  # fmt: skip
    if others or not config.cache.enable_prefix_caching:
        log.info("window layers keep KV for every cached token (%s)",
                 ", ".join(others) or "prefix cache off")  # fmt: skip
        return 0.0
    return config.cache.window_kv_share


def build_cache(
    config: EngineConfig,
    allocator: PagedAllocator,
    pool: KVPool,
    events: KVEventQueue | None,
    model_path: Path,
    model_name: str,
) -> tuple[PrefixCache, LowerTiers]:
    """The prefix cache over the device pool and the tiers below it."""
    tiers = config.tiers
    if not is_tiered(config):
        return device_cache(config, allocator, events), NO_TIERS
    fmt = pool.shape.int8_format if tiers.kv_tier_dtype == "int8" else pool.format
    slots = host_slots(config, allocator.num_slots, pool.shape.with_format(fmt).bytes_per_token())
    host = HostKVPool(pool, slots, allocator.page_size, fmt)
    cache, controller = tiered_cache(config, allocator, host, events)
    log.info("host KV tier: %d tokens (%.2f GiB%s, %s), write policy %s", host.num_slots,
             host.nbytes() / 2**30, "" if tiers.host_kv_memory else ", sized by default",
             fmt.name, tiers.write_policy)  # fmt: skip
    if tiers.kv_storage is not None:
        storage = controller.attach_storage(
            tiers.kv_storage, model_identity(model_path, model_name),
            tiers.kv_storage_size, tiers.storage_prefetch_min_tokens,
            tiers.storage_prefetch_timeout, tiers.kv_storage_block_tokens,
        )  # fmt: skip
        log.info("KV storage tier: %s, blocks of %d tokens", tiers.kv_storage,
                 storage.block_tokens)  # fmt: skip
    return cache, controller


def is_tiered(config: EngineConfig) -> bool:
    """Whether the config asks for tiers below the device pool (and the prefix cache is on)."""
    tiers = config.tiers
    on = tiers.host_kv_memory is not None or tiers.kv_storage is not None
    return on and config.cache.enable_prefix_caching


def device_cache(
    config: EngineConfig,
    allocator: PagedAllocator,
    events: KVEventQueue | None,
    eviction_policy: str | EvictionPolicy | None = None,
) -> PrefixCache:
    """The cache of a device pool alone: the radix tree, or ``NullCache`` with the prefix
    cache off. ``eviction_policy``: an object instead of the config's policy name."""
    caching = config.cache
    if not caching.enable_prefix_caching:
        return NullCache(allocator)
    return radix_cache(config, allocator, events, eviction_policy)


def radix_cache(
    config: EngineConfig,
    allocator: PagedAllocator,
    events: KVEventQueue | None,
    eviction_policy: str | EvictionPolicy | None = None,
) -> RadixCache:
    """The radix tree over the device pool, with the config's eviction policy and events."""
    caching = config.cache
    return RadixCache(allocator, eviction_policy or caching.eviction_policy, events,
                      config.kv_events.kv_events_block_size, caching.cache_threshold)  # fmt: skip


def host_slots(config: EngineConfig, device_slots: int, bytes_per_token: int) -> int:
    """The host tier's size in slots (whole pages): ``host_kv_memory`` or, without it, the
    default share of free RAM; it must hold more than the device pool."""
    host_bytes = config.tiers.host_kv_memory
    if host_bytes is None:
        host_bytes = default_host_kv_bytes(device_slots * bytes_per_token)
    page = config.cache.page_size
    slots = int(host_bytes) // bytes_per_token // page * page
    if slots <= device_slots:
        raise ValueError(
            f"host_kv_memory ({host_bytes} bytes"
            f"{'' if config.tiers.host_kv_memory else ', default'}) holds {slots} tokens of KV, "
            f"no more than the device pool ({device_slots} tokens); the host tier must be "
            "larger than the device pool"
        )
    return slots


def tiered_cache(
    config: EngineConfig,
    allocator: PagedAllocator,
    host: HostKVPool,
    events: KVEventQueue | None,
    eviction_policy: str | EvictionPolicy | None = None,
) -> tuple[RadixCache, TierController]:
    """The radix tree over the device pool and the tier controller that moves KV between it
    and ``host``, with the config's write policy (the server's and the simulator's)."""
    tree = radix_cache(config, allocator, events, eviction_policy)
    tiers = config.tiers
    return tree, TierController(tree, host, tiers.write_policy, tiers.load_back_min_tokens)


def model_identity(path: Path, name: str) -> str:
    """Names these weights: equal for the same model files, different for any other weights.
    A digest of each file's name, size, and its first, middle and last MiB."""
    h = hashlib.blake2b(digest_size=16)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2),
                                  max(0, size - SAMPLE_BYTES)}):  # fmt: skip
                fh.seek(offset)
                h.update(fh.read(SAMPLE_BYTES))
    return f"{name}-{h.hexdigest()}"


def pin_table(config: EngineConfig, cache: PrefixCache, tiers: LowerTiers) -> PinTable | None:
    """The pins over the radix tree within the config's budgets (shares of the device pool),
    or None: no prefix cache, or a budget of 0."""
    caching = config.cache
    if not isinstance(cache, RadixCache) or caching.pin_budget == 0:
        return None
    capacity = cache.allocator.num_slots
    share = caching.pin_budget if caching.pin_tenant_budget is None else caching.pin_tenant_budget
    return PinTable(
        cache, int(caching.pin_budget * capacity), int(share * capacity), backup=tiers.backup
    )
