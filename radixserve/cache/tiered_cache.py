"""TieredRadixCache: the radix tree over the device pool with a host pool below it (and,
once ``attach_storage`` is called, a storage tier below that).

It is a ``RadixCache`` with a ``TierController`` attached: the tree records where each node's
KV lives, the controller (``tier_controller.py``) owns every copy between the tiers. This
class only builds the pair and names the controller's parts for callers that configure or
inspect them.
"""

from __future__ import annotations

from radixserve.cache.allocator import PagedAllocator
from radixserve.cache.events import KVEventQueue
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.storage_io import StorageIO
from radixserve.cache.tier_controller import WRITE_POLICIES, TierController

__all__ = ["WRITE_POLICIES", "TieredRadixCache"]


class TieredRadixCache(RadixCache):
    def __init__(
        self,
        allocator: PagedAllocator,
        host: HostKVPool,
        write_policy: str = "write_through_selective",
        eviction_policy: str = "lru",
        event_queue: KVEventQueue | None = None,
        load_back_min_tokens: int = 1,
        event_block_size: int | None = None,
        cache_threshold: float | None = None,
    ):
        super().__init__(allocator, eviction_policy, event_queue, event_block_size, cache_threshold)
        self.controller: TierController = TierController(
            self, host, write_policy, load_back_min_tokens
        )

    @property
    def host(self) -> HostKVPool:
        return self.controller.host

    @property
    def write_policy(self) -> str:
        return self.controller.write_policy

    @property
    def load_back_min_tokens(self) -> int:
        return self.controller.load_back_min_tokens

    @load_back_min_tokens.setter
    def load_back_min_tokens(self, n: int) -> None:
        self.controller.load_back_min_tokens = n

    @property
    def storage(self) -> StorageIO | None:
        return self.controller.storage

    def attach_storage(self, url: str, model_id: str, capacity_bytes: int | None,
                       min_tokens: int, timeout: float,
                       block_tokens: int = 64) -> StorageIO:  # fmt: skip
        return self.controller.attach_storage(
            url, model_id, capacity_bytes, min_tokens, timeout, block_tokens
        )
