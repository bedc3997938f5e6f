"""A real engine with a KV-event publisher, and a subscriber's view of its stream, for the
KV-event tests."""

import asyncio

import numpy as np

from radixserve.cache.tree_check import walk
from radixserve.engine import SamplingParams
from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.kvevents.publisher import KVEventPublisher
from radixserve.kvevents.types import BlockRemoved, BlockStored
from radixserve.links.keys import CurveKeys
from radixserve.server.event_bridge import EventBridge

KEYS = CurveKeys.generate()  # the publisher's and its subscribers' (a fleet key pair)


class Index:
    """A subscriber's view: hash -> tokens, set semantics."""

    def __init__(self):
        self.blocks: dict[int, tuple] = {}
        self.resets = 0

    def apply(self, events):
        for e in events:
            if isinstance(e, BlockStored):
                for i, h in enumerate(e.block_hashes):
                    self.blocks[h] = tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.blocks.pop(h, None)
            else:
                self.blocks.clear()

    def reset(self):
        self.resets += 1
        self.blocks.clear()


def expected_blocks(cache):
    out = set()
    for node, _ in walk(cache):
        path, n = [], node
        while n.parent is not None:
            path.append(n.key)
            n = n.parent
        out.update(prompt_block_hashes(np.concatenate(path[::-1]), cache.event_block_size))
    return out


class Harness:
    """An engine with a publisher; ``run`` plays the engine thread between awaits."""

    def __init__(self, engine, buffer_steps=10_000, security=KEYS):
        self.engine = engine
        self.pub = KVEventPublisher(
            "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=buffer_steps, security=security
        )
        self.endpoint, self.replay = self.pub.start()
        self.bridge = EventBridge(engine, self.pub)
        self.n = 0

    async def settle(self, *subs, rounds=200):
        for _ in range(rounds):
            self.bridge.sync()
            await asyncio.sleep(0.01)
            last = self.pub._last_seq
            if all(s.synced.is_set() and (s.next_seq or 0) > last for s in subs):
                return
        raise AssertionError("the subscribers did not catch up")

    async def run(self, prompts, max_tokens=2):
        for p in prompts:
            self.n += 1
            self.engine.add_request(f"r{self.n}", p, SamplingParams(max_tokens=max_tokens))
        while self.engine.has_unfinished():
            self.engine.step()
            self.bridge.sync()
            await asyncio.sleep(0)


def prompts(rng, n, system):
    return [system + rng.integers(5, 4000, int(rng.integers(5, 90))).tolist() for _ in range(n)]
