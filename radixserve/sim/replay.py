"""Cache-only replay: one request after another through the real tree, no timing.

The classic way to compare eviction policies: every policy sees the same requests in the same
order, so hit rates differ only by what each policy kept. Each request goes through the
engine's own ledger (``RequestKV``): match and lock its prefix, count the hit, allocate and
commit its uncached prompt and publish it (the prompt enters the tree when its prefill ends,
as in the engine), then allocate and commit its output and release (which inserts the output
below the prompt, as a finished request does). Eviction makes room at both allocations.

The order (``replay_order``) is the trace's arrival order when every request takes no time:
timed sessions by their timestamps plus think times; untimed ones as the closed loop of the
event loop would run them if all requests took equal time (``concurrency`` sessions in
flight, one turn each in turn) or as Poisson starts (``session_rate``).

Designs compared by ``replay`` with ``design``: ``tree`` (the radix tree, page size 1: every
token reusable), ``blocks`` (the same tree at page size 16: only whole 16-token blocks are
cached and matched, as in vLLM's hashed-block prefix cache) and ``slots`` (one cache per
server slot, as llama.cpp's server keeps: see ``slot_replay``). Policies: any online one,
an offline oracle (``oracle.ORACLES``: ``belady`` and two that know less of the future),
``reuse-hindsight`` or ``unbounded`` (a pool holding everything).

``reuse-hindsight`` is the online ``reuse`` policy whose reuse model starts from the model a
first replay of the same order (same pool) learned: it knows from the start how often each
class of leaf returns on this trace, and no request's own future. What ``reuse`` could reach
were its learning perfect: an estimate of the ceiling of its features, with no oracle.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.cache import PagedAllocator, RadixCache
from radixserve.cache.eviction_reuse import ReusePolicy
from radixserve.engine.kv_manager import RequestKV
from radixserve.engine.request import Request
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.spec import RequestSpec
from radixserve.sim.oracle import ORACLES, FutureUses
from radixserve.sim.trace import Session, Trace, Turn

Order = list[tuple[Session, Turn]]
_GREEDY = SamplingParams(temperature=0.0, seed=0)
HINDSIGHT = "reuse-hindsight"
OFFLINE_POLICIES = (*ORACLES, HINDSIGHT, "unbounded")


def replay_order(
    trace: Trace, concurrency: int | None = None, session_rate: float | None = None, seed: int = 0
) -> Order:
    sessions = trace.sessions
    if trace.timed or session_rate is not None:
        if trace.timed:
            starts = [float(s.arrival) for s in sessions]
        else:
            gaps = np.random.default_rng(seed).exponential(1.0 / session_rate, len(sessions))
            starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()
        events = []
        for i, (s, t0) in enumerate(zip(sessions, starts, strict=True)):
            t = t0
            for k, turn in enumerate(s.turns):
                t += turn.think_time if k else 0.0
                events.append((t, i, k))
        events.sort()
        return [(sessions[i], sessions[i].turns[k]) for _, i, k in events]
    # closed loop, every request one time unit: a heap of (next free time, session)
    order: Order = []
    active = [(0, i, 0) for i in range(min(concurrency or 1, len(sessions)))]
    heapq.heapify(active)
    nxt = len(active)
    while active:
        t, i, k = heapq.heappop(active)
        s = sessions[i]
        order.append((s, s.turns[k]))
        if k + 1 < len(s.turns):
            heapq.heappush(active, (t + 1, i, k + 1))
        elif nxt < len(sessions):
            heapq.heappush(active, (t + 1, nxt, 0))
            nxt += 1
    return order


@dataclass
class ReplayResult:
    policy: str
    kv_tokens: int
    page_size: int
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    evicted_tokens: int
    tree_tokens: int  # cached at the end

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def computed(turn: Turn) -> np.ndarray:
    """What a finished request leaves in the tree: prompt and output but the last token."""
    return np.concatenate([turn.prompt, turn.output[:-1]]) if len(turn.output) else turn.prompt


def peak_live_tokens(order: Order) -> int:
    """The most tokens live sessions hold at once: a session is live from its first request
    to its last, and holds its latest prompt and output. What a cache needs to serve every
    conversation in progress from memory (counting a shared prefix once per session)."""
    last = {id(s): j for j, (s, _) in enumerate(order)}
    held: dict[int, int] = {}
    size = peak = 0
    for j, (s, t) in enumerate(order):
        now = len(t.prompt) + len(t.output)
        size += now - held.get(id(s), 0)
        held[id(s)] = now
        peak = max(peak, size)
        if last[id(s)] == j:
            size -= held.pop(id(s))
    return peak


def total_tokens(order: Order) -> int:
    return sum(len(t.prompt) + len(t.output) for _, t in order)


def replay(
    order: Order,
    kv_tokens: int,
    policy: str = "lru",
    page_size: int = 1,
    cache_threshold: float | None = None,
    future: FutureUses | None = None,
) -> ReplayResult:
    """Replay ``order`` through a tree of ``kv_tokens`` slots with ``policy``."""
    if cache_threshold is not None and (not isinstance(policy, str) or policy in OFFLINE_POLICIES):
        raise ValueError(f"cache_threshold applies to online policies by name, not {policy!r}")
    if policy == "unbounded":
        kv_tokens = total_tokens(order) + page_size
        evict: Any = "lru"
    elif not isinstance(policy, str):
        evict = policy
    elif policy == HINDSIGHT:
        first = ReusePolicy()
        replay(order, kv_tokens, first, page_size)
        evict = ReusePolicy(prior=first.model)
    elif policy in ORACLES:
        future = future or FutureUses(
            [(t.prompt, computed(t), s.namespace) for s, t in order], page_size
        )
        evict = ORACLES[policy](future)
    else:
        evict = policy
    alloc = PagedAllocator(kv_tokens, page_size)
    cache = RadixCache(alloc, evict, cache_threshold=cache_threshold)
    kv = RequestKV(cache, alloc)
    failed = prompt_tokens = cached = 0
    for j, (s, turn) in enumerate(order):
        req = _known_request(str(j), turn, s.namespace)
        prompt_tokens += req.prompt_len
        need = -(-(req.prompt_len + req.max_tokens) // page_size)
        match = kv.match(req)
        kv.admit(req, match)
        kv.record_admission(req, match.device_len)  # before eviction: the oracle's clock
        n = req.prompt_len - req.kv.cached
        if need > alloc.num_pages or not kv.extend(req, n):
            kv.release(req)
            failed += 1
            continue
        cached += req.usage.cached_tokens
        kv.commit(req, n)
        kv.publish(req)  # the prompt joins the tree as its prefill ends, as the engine's does
        req.append_tokens(turn.output if len(turn.output) else np.zeros(1, np.int32))
        n = req.max_tokens - 1  # the last output token's KV is never computed
        if not kv.extend(req, n):  # cannot fail: the pool holds the request, the rest unlocked
            raise AssertionError(f"request {j}: no room for its output")
        kv.commit(req, n)
        kv.release(req)
    return ReplayResult(cache.eviction_policy if policy not in OFFLINE_POLICIES else policy,
                        kv_tokens, page_size, len(order), failed, prompt_tokens, cached,
                        cache.stats.evicted_tokens, cache.total_size())  # fmt: skip


def _known_request(request_id: str, turn: Turn, namespace: str | None) -> Request:
    """A request whose output is the turn's (at least one token)."""
    spec = RequestSpec(request_id=request_id, prompt_ids=turn.prompt, params=_GREEDY,
                       namespace=namespace)  # fmt: skip
    return Request(spec, max(len(turn.output), 1), 0)


LLAMACPP_SLOT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity default


def slot_replay(
    order: Order, num_slots: int, slot_tokens: int, similarity: float = LLAMACPP_SLOT_SIMILARITY
) -> ReplayResult:
    """llama.cpp's server: each slot keeps its last sequence; a request takes the slot with
    the longest common prefix among those whose common prefix exceeds ``similarity`` of the
    slot's cached length, else the least recently used slot, and reuses that prefix. Requests
    run one at a time, so every slot is idle."""
    slots: list[np.ndarray] = [np.empty(0, np.int32)] * num_slots
    last_used = [0] * num_slots
    failed = prompt_tokens = cached = 0
    for j, (_, turn) in enumerate(order):
        prompt_tokens += len(turn.prompt)
        if len(turn.prompt) + len(turn.output) > slot_tokens:
            failed += 1
            continue
        query = turn.prompt[:-1]
        best, best_len = min(range(num_slots), key=last_used.__getitem__), -1
        for i, seq in enumerate(slots):
            common = _common_prefix(seq, query)
            if common > max(best_len, 0) and common > similarity * len(seq):
                best, best_len = i, common
        if best_len < 0:  # no slot similar enough: the least recently used one, whatever it holds
            best_len = _common_prefix(slots[best], query)
        cached += best_len
        slots[best], last_used[best] = computed(turn), j + 1
    return ReplayResult("slots", num_slots * slot_tokens, 1, len(order), failed, prompt_tokens,
                        cached, 0, sum(len(s) for s in slots))  # fmt: skip


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if len(differs) else n
