"""KV events over ZeroMQ: vLLM's wire format, the publisher in front of a real engine, and a
subscriber that rebuilds the tree's blocks from the stream, recovering lost messages by
replay and by a dump."""

import asyncio

import msgspec
import numpy as np
import pytest

from radixserve.cache.tree_check import walk
from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.kvevents.subscriber import EventSubscriber
from radixserve.kvevents.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    medium_window,
    windowless_medium,
)
from radixserve.kvevents.wire import decode_batch, encode_batch
from testing.kv_events import KEYS, Harness, Index, expected_blocks, prompts


# vLLM v0.11.2's event types (vllm/distributed/kv_events.py), declared here as the reference
# decoder: what a vLLM-reading router would do with our bytes.
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


def test_wire_format_is_vllms():
    h = prompt_block_hashes(range(32), 16)
    batch = EventBatch(
        12.5,
        [
            BlockStored(h, None, list(range(32)), 16),
            BlockRemoved(h[1:], medium="host"),
            AllBlocksCleared(),
            BlockStored(h[1:], h[0], list(range(16, 32)), 16, medium="storage"),
        ],
    )
    payload = encode_batch(batch)
    v = msgspec.msgpack.decode(payload, type=VKVEventBatch)
    assert v.ts == 12.5 and v.data_parallel_rank is None
    stored, removed, cleared, lower = v.events
    assert stored == VBlockStored(h, None, list(range(32)), 16, None, "GPU")
    assert removed == VBlockRemoved(h[1:], "CPU") and isinstance(cleared, VAllBlocksCleared)
    assert lower.medium == "STORAGE" and lower.parent_block_hash == h[0]
    assert all(0 <= x < 2**64 for x in h)
    assert decode_batch(payload) == batch  # and we read it back


def test_decoder_reads_newer_vllm_layouts():
    """Newer vLLM sends extra trailing fields, or events as maps with a type tag."""
    import msgpack

    h = [1, 2]
    arrays = [1.0, [["BlockStored", h, None, [5] * 32, 16, None, "GPU", "lora", None, 0]]]
    maps = [1.0, [{"type": "BlockRemoved", "block_hashes": h, "medium": "CPU", "group_idx": 0}]]
    assert decode_batch(msgpack.packb(arrays)).events == [BlockStored(h, None, [5] * 32, 16)]
    assert decode_batch(msgpack.packb(maps)).events == [BlockRemoved(h, medium="host")]


def test_window_less_blocks_cross_the_wire_as_a_medium_of_their_own():
    """A vLLM reader parses them as blocks on a medium it does not know, never as "GPU"; we
    read them back with their window; a medium we do not know stays unknown, not the device."""
    import msgpack

    h = prompt_block_hashes(range(32), 16)
    medium = windowless_medium(512)
    batch = EventBatch(3.0, [BlockStored(h, None, list(range(32)), 16, medium=medium),
                             BlockRemoved(h[1:], medium=medium)])  # fmt: skip
    payload = encode_batch(batch)
    v = msgspec.msgpack.decode(payload, type=VKVEventBatch)
    assert [e.medium for e in v.events] == ["GPU_WINDOWLESS:512"] * 2
    assert v.events[0] == VBlockStored(h, None, list(range(32)), 16, None, "GPU_WINDOWLESS:512")
    back = decode_batch(payload)
    assert back == batch and medium_window(back.events[1].medium) == 512
    other = [2.0, [["BlockRemoved", h, "LocalDiskBackend"], ["BlockRemoved", h]]]
    unknown, bare = decode_batch(msgpack.packb(other)).events
    assert unknown.medium == "LocalDiskBackend" and medium_window(unknown.medium) is None
    assert bare.medium == "device"  # no medium at all: vLLM's GPU


async def _follow(engine):
    h = Harness(engine)
    seen = Index()
    sub = EventSubscriber(h.endpoint, h.replay, seen.apply, seen.reset, security=KEYS)
    task = asyncio.create_task(sub.run())
    try:
        rng = np.random.default_rng(0)
        system = rng.integers(5, 4000, 40).tolist()
        assert not h.pub.subscribed and engine.kv_events is None  # nobody listens: no events
        await h.run(prompts(rng, 4, system))  # the tree has pages before anyone subscribes
        await h.settle(sub)
        assert engine.kv_events is not None
        assert set(seen.blocks) == expected_blocks(engine.cache) != set()
        for _ in range(3):  # more traffic: inserts, splits, evictions (a small pool)
            await h.run(prompts(rng, 5, system))
            await h.settle(sub)
            assert set(seen.blocks) == expected_blocks(engine.cache)
        assert engine.cache.stats.evicted_tokens > 0
        engine.flush_cache()
        await h.settle(sub)
        assert seen.blocks == {} and expected_blocks(engine.cache) == set()
    finally:
        task.cancel()
        h.pub.close()
    await asyncio.sleep(0)


def test_a_subscriber_rebuilds_the_tree_from_events(make_engine):
    asyncio.run(_follow(make_engine(max_total_tokens=600, max_running_requests=4)))


async def _recover(engine, buffer_steps):
    h = Harness(engine, buffer_steps)
    seen = Index()
    sub = EventSubscriber(h.endpoint, h.replay, seen.apply, seen.reset, security=KEYS)
    original = sub._receive
    dropped = []

    async def lossy(seq, batch):  # the network loses every 5th batch on the way to us
        if seq % 5 == 3:
            dropped.append(seq)
            return
        await original(seq, batch)

    sub._receive = lossy
    task = asyncio.create_task(sub.run())
    try:
        rng = np.random.default_rng(1)
        system = rng.integers(5, 4000, 40).tolist()
        for _ in range(4):
            await h.run(prompts(rng, 3, system))
        await h.run(prompts(rng, 1, system))
        await h.settle(sub)
        assert dropped
        assert set(seen.blocks) == expected_blocks(engine.cache)
        late = Index()  # a second subscriber, joining while events are already on
        sub2 = EventSubscriber(h.endpoint, h.replay, late.apply, late.reset, security=KEYS)
        task2 = asyncio.create_task(sub2.run())
        await h.run(prompts(rng, 2, system))
        await h.settle(sub, sub2)
        assert set(late.blocks) == set(seen.blocks) == expected_blocks(engine.cache)
        task2.cancel()
        return sub
    finally:
        task.cancel()
        h.pub.close()


def test_replay_recovers_dropped_messages(make_engine):
    sub = asyncio.run(_recover(make_engine(max_total_tokens=600), buffer_steps=10_000))
    assert sub.replays > 0 and sub.dumps == 1  # the one dump at start


def test_a_dump_recovers_what_replay_no_longer_holds(make_engine):
    sub = asyncio.run(_recover(make_engine(max_total_tokens=600), buffer_steps=1))
    assert sub.dumps > 1


@pytest.mark.parametrize("flag", ["enable", "disable"])
def test_no_subscriber_no_events(make_engine, flag):
    engine = make_engine(max_total_tokens=600)
    h = Harness(engine)
    try:
        asyncio.run(h.run([list(range(10, 90))]))
        assert engine.kv_events is None and h.pub.published_batches == 0
        assert all(not n.page_hashes for n, _ in walk(engine.cache))
    finally:
        h.pub.close()
