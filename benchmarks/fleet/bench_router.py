"""Router and KV-event overheads, measured on this machine. Prints one JSON line.

1. Routing overhead: real ShareGPT conversations (the bench's data, replayed turn by turn
   with a fixed 40-word answer per turn), tokenized with the default model's chat template
   and hashed exactly as ``radixserve router`` does (``router.prompts.route_request``), then
   routed by the cache-aware policy over N simulated workers whose KV events confirm every
   prompt. Reports p50/p99 of the preparation (tokenize + hash) and of the policy decision,
   for N = 4 and N = 1000 (the decision must not grow with the fleet).
2. KV events with no subscriber: the same engine workload (default model) run with no
   publisher, with a publisher nobody subscribes to, and with a subscriber draining the
   stream; reports engine step time per mode (interleaved runs, best of each).

Usage: python -m benchmarks.fleet.bench_router [--conversations 40] [--skip-engine]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import zmq

from radixserve.bench import data
from radixserve.kvevents.types import BlockStored
from radixserve.model.loader import default_model_path
from radixserve.model.tokenizer import Tokenizer
from radixserve.router.policy import PolicyConfig, make_policy
from radixserve.router.prompts import route_request

ANSWER = " ".join(["the answer goes on"] * 10)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def routing(conversations: int, workers: int, tokenizer: Tokenizer) -> dict:
    policy = make_policy("cache-aware", PolicyConfig(block_size=16))
    for i in range(workers):
        policy.add_worker(f"w{i}", has_events=True)
    chats = list(itertools.islice(data.iter_sharegpt(None), conversations))
    prepare, decide, hits, prompt = [], [], 0, 0
    now = 0.0
    for _cid, turns in chats:
        history = []
        for user in turns[:5]:
            history.append({"role": "user", "content": user[:800]})
            body = {"model": "m", "messages": history}
            t0 = time.perf_counter()
            wanted = route_request("/v1/chat/completions", body, {}, tokenizer, 16)
            t1 = time.perf_counter()
            route = policy.route(wanted, now)
            t2 = time.perf_counter()
            prepare.append(t1 - t0)
            decide.append(t2 - t1)
            hits += route.cached_tokens
            prompt += wanted.num_tokens
            hashes = list(wanted.block_hashes)
            policy.apply_events(route.worker, [BlockStored(hashes, None, [], 16)])
            policy.finish(route.ticket)
            history.append({"role": "assistant", "content": ANSWER})
            now += 0.1
    ms = 1e3
    return {
        "workers": workers,
        "requests": len(decide),
        "prepare_p50_ms": statistics.median(prepare) * ms,
        "prepare_p99_ms": pct(prepare, 0.99) * ms,
        "decide_p50_ms": statistics.median(decide) * ms,
        "decide_p99_ms": pct(decide, 0.99) * ms,
        "predicted_hit_rate": hits / prompt,
    }


def engine_modes(rounds: int = 2) -> dict:
    from radixserve.config import EngineConfig
    from radixserve.engine import Engine, SamplingParams
    from radixserve.kvevents.publisher import KVEventPublisher
    from radixserve.links.keys import CurveKeys
    from radixserve.server.event_bridge import EventBridge

    engine = Engine(
        EngineConfig.from_options(dtype="float32", max_total_tokens=6000, load_progress=False)
    )
    words = " ".join(f"word{i}" for i in range(150))
    prompts = [engine.tokenizer.encode(f"{i} {words} {i}") for i in range(12)]
    results: dict[str, list[float]] = {"no-publisher": [], "no-subscriber": [], "subscriber": []}
    keys = CurveKeys.generate()  # as served: CurveZMQ on the event sockets
    for r in range(rounds):
        for mode in results:
            engine.flush_cache()
            pub = bridge = sub = None
            if mode != "no-publisher":
                pub = KVEventPublisher("tcp://127.0.0.1:0", security=keys)
                endpoint, _ = pub.start()
                bridge = EventBridge(engine, pub)
            if mode == "subscriber":
                sub = zmq.Context.instance().socket(zmq.SUB)
                keys.client(sub)
                sub.connect(endpoint)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                while not pub.subscribed:
                    time.sleep(0.01)
            for i, p in enumerate(prompts):
                engine.add_request(f"{mode}-{r}-{i}", p, SamplingParams(max_tokens=8))
            t0 = time.perf_counter()
            steps = 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
                if bridge is not None:
                    bridge.sync()
                while sub is not None and sub.poll(0):
                    sub.recv_multipart()
            results[mode].append((time.perf_counter() - t0) / steps)
            if bridge is not None:
                bridge.sync()
                engine.set_kv_events(False)
            if sub is not None:
                sub.close(linger=0)
            if pub is not None:
                pub.close()
    return {f"{mode}_step_ms": min(ts) * 1e3 for mode, ts in results.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()
    tokenizer = Tokenizer.from_model_path(default_model_path(), [])
    out = {
        "routing_n4": routing(args.conversations, 4, tokenizer),
        "routing_n1000": routing(args.conversations, 1000, tokenizer),
    }
    if not args.skip_engine:
        out["kv_events"] = engine_modes()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
