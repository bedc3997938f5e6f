"""The pure routing policies, driven with simulated workers and simulated time."""

import random
import time

import pytest

from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.kvevents.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    windowless_medium,
)
from radixserve.router.load import LoadBoard
from radixserve.router.policy import (
    POLICIES,
    NoWorkerError,
    PolicyConfig,
    RouteRequest,
    make_policy,
)

B = 16


def request(tokens, session=None):
    return RouteRequest(prompt_block_hashes(tokens, B), len(tokens), session)


def conversation(seed, turns, turn_len=64):
    """Token ids of each turn's prompt: every turn extends the previous one."""
    rng = random.Random(seed)
    history, prompts = [], []
    for _ in range(turns):
        history = history + [rng.randrange(50_000) for _ in range(turn_len)]
        prompts.append(list(history))
    return prompts


def stored(tokens):
    return [BlockStored(prompt_block_hashes(tokens, B), None, list(tokens), B)]


def home_first_turns(policy, count):
    """Route the first turn of conversations 0..count-1 (their KV stored where they land,
    each request finished); return each conversation's worker."""
    homes = {}
    for c in range(count):
        tokens = conversation(c, 2)[0]
        route = policy.route(request(tokens), now=0)
        policy.apply_events(route.worker, stored(tokens))
        policy.finish(route.ticket)
        homes[c] = route.worker
    return homes


def fleet(name, n=4, events=True, **config):
    policy = make_policy(name, PolicyConfig(block_size=B, **config), seed=1)
    for i in range(n):
        policy.add_worker(f"w{i}", has_events=events)
    return policy


@pytest.mark.parametrize("events", [True, False])
def test_turns_of_a_conversation_stick_to_one_worker(events):
    policy = fleet("cache-aware", events=events)
    homes = {}
    for turn in range(4):
        for c in range(8):
            tokens = conversation(c, 4)[turn]
            route = policy.route(request(tokens), now=turn)
            if events:  # the worker computed the prompt and says so
                policy.apply_events(route.worker, stored(tokens))
            policy.first_token(route.ticket)
            policy.finish(route.ticket, cached_tokens=route.cached_tokens)
            assert homes.setdefault(c, route.worker) == route.worker, f"conversation {c}"
            if turn:
                assert route.source == ("exact" if events else "approx")
                assert route.cached_tokens == len(conversation(c, 4)[turn - 1]) // B * B
    assert len(set(homes.values())) == 4  # new conversations spread over the fleet
    assert policy.board.total_running() == 0 and policy.in_flight() == 0


def test_an_overloaded_worker_gets_no_new_conversations_and_others_keep_affinity():
    policy = fleet("cache-aware", gate_tokens=256)
    homes = home_first_turns(policy, 8)  # one turn each, spread over the fleet
    hot = homes[0]
    others = [w for w in policy.workers if w != hot]
    stuck = []
    for _ in range(30):  # long requests pile up on one worker (e.g. another client's)
        r = policy.route(RouteRequest([], 2000), now=1, exclude=others)
        stuck.append(r)
        policy.first_token(r.ticket)
    assert {r.worker for r in stuck} == {hot}
    for c in range(8):  # second turns
        route = policy.route(request(conversation(c, 2)[1]), now=2)
        if homes[c] == hot:
            assert route.worker != hot  # the gate: its prefix is not worth the queue
        else:
            assert route.worker == homes[c] and route.source == "exact"
        policy.finish(route.ticket)
    for c in range(8, 16):  # new conversations avoid the hot worker
        route = policy.route(request(conversation(c, 1)[0]), now=3)
        assert route.worker != hot
        policy.finish(route.ticket)
    for r in stuck:
        policy.finish(r.ticket)
    assert policy.board.total_running() == 0


def test_a_miss_goes_to_the_least_loaded_worker_not_the_busiest():
    policy = fleet("cache-aware")
    busy = [policy.route(RouteRequest([], 100), now=0) for _ in range(6)]
    loads = {w: policy.board.load(w) for w in policy.workers}
    route = policy.route(request(list(range(64))), now=0)
    assert loads[route.worker] == min(loads.values())
    for r in [*busy, route]:
        policy.finish(r.ticket)


@pytest.mark.parametrize("name", POLICIES)
def test_load_counters_return_to_zero_on_every_path(name):
    policy = fleet(name)
    rng = random.Random(0)
    tickets = []
    for i in range(200):
        r = policy.route(request(conversation(i % 10, 1)[0], session=str(i % 10)), now=i)
        if rng.random() < 0.5:
            policy.first_token(r.ticket)
        tickets.append(r.ticket)
        if rng.random() < 0.5:  # finished, aborted, or failed: all end the ticket
            policy.finish(tickets.pop(rng.randrange(len(tickets))))
    for t in tickets:
        policy.finish(t)
        policy.finish(t)  # a second finish changes nothing
    assert policy.in_flight() == 0
    assert all(policy.board.load(w) == 0 for w in policy.workers)


def test_events_remove_and_clear_entries():
    policy = fleet("cache-aware", n=2)
    tokens = list(range(64))
    policy.apply_events("w1", stored(tokens))
    r = policy.route(request(tokens), now=0)
    assert (r.worker, r.cached_tokens, r.source) == ("w1", 64, "exact")
    policy.finish(r.ticket)
    hashes = prompt_block_hashes(tokens, B)
    policy.apply_events("w1", [BlockRemoved(hashes[2:])])
    policy.index.clear_worker("w0")  # drop approximate entries the routes made
    policy.index.clear_worker("w1")
    policy.apply_events("w1", stored(tokens[:32]))
    r = policy.route(request(tokens), now=1)
    assert (r.worker, r.cached_tokens) == ("w1", 32)
    policy.finish(r.ticket)
    policy.apply_events("w1", [AllBlocksCleared()])
    assert policy.index.size()[0] == 0


def windowless(tokens, blocks, window):
    """The event marking ``blocks`` (indices) of a prompt window-less, one block each."""
    hashes = prompt_block_hashes(tokens, B)
    return [BlockStored([hashes[i]], hashes[i - 1] if i else None, tokens[i * B : (i + 1) * B],
                        B, medium=windowless_medium(window)) for i in blocks]  # fmt: skip


def test_window_less_blocks_cut_a_match_where_the_engine_would():
    """The W - 1 = 2B tokens before a resume point (2 blocks) need their window KV: a match
    ends at the start of the last window-less block among them, again until none is."""
    policy = fleet("cache-aware", n=2)
    tokens = list(range(10 * B))
    hashes = prompt_block_hashes(tokens, B)
    index, window = policy.index, 2 * B + 1
    policy.apply_events("w0", stored(tokens))
    for marks, expected in (([3], 10), ([8], 8), ([7], 7), ([5], 3), ([], 3)):
        policy.apply_events("w0", windowless(tokens, marks, window))
        assert index.resumable("w0", hashes, 10, B) == expected
    assert [index.resumable("w0", hashes, n, B) for n in range(11)] == [0, 1, 2] + [3] * 8
    policy.apply_events("w1", stored(tokens[: 6 * B]))  # a shallower match without tombstones
    r = policy.route(request(tokens), now=0)
    assert (r.worker, r.cached_tokens) == ("w1", 6 * B)
    policy.finish(r.ticket)
    # revival: the marks go, and w0 resumes its whole match again
    policy.apply_events("w0", [BlockRemoved(hashes[i : i + 1], medium=windowless_medium(window))
                               for i in (3, 5, 7, 8)])  # fmt: skip
    policy.index.clear_worker("w1")  # and the approximate entries the route made
    assert index.resumable("w0", hashes, 10, B) == 10
    r = policy.route(request(tokens), now=1)
    assert (r.worker, r.cached_tokens) == ("w0", 10 * B)
    policy.finish(r.ticket)
    # a device block that leaves takes its mark along (whatever was lost of the stream)
    policy.apply_events("w0", windowless(tokens, [9], window) + [BlockRemoved(hashes[9:])])
    policy.apply_events("w0", stored(tokens))
    assert index.resumable("w0", hashes, 10, B) == 10


def test_a_medium_the_index_does_not_know_is_skipped():
    policy = fleet("cache-aware", n=1)
    tokens = list(range(4 * B))
    hashes = prompt_block_hashes(tokens, B)
    policy.apply_events("w0", [BlockStored(hashes, None, tokens, B, medium="LocalDiskBackend")])
    assert policy.index.size() == (0, 0)
    policy.apply_events("w0", stored(tokens) + [BlockRemoved(hashes, medium="LocalDiskBackend")])
    assert policy.index.depth_of("w0", hashes, 4, now=0) == 4


def test_approximate_entries_expire():
    policy = fleet("cache-aware", n=2, events=False, approx_ttl_no_events=10.0)
    tokens = list(range(64))
    first = policy.route(request(tokens), now=0)
    policy.finish(first.ticket)
    again = policy.route(request(tokens), now=5)
    assert again.worker == first.worker and again.source == "approx"
    policy.finish(again.ticket)
    late = policy.route(request(tokens), now=100)
    assert late.source == "none"
    policy.finish(late.ticket)
    assert policy.index.size() == (0, 4)  # the last route's entries, live until 110
    assert policy.index.sweep(now=1000) == 4 and policy.index.size() == (0, 0)


def test_tier_cost_prefers_a_device_copy():
    policy = fleet("cache-aware", n=2)
    tokens = list(range(64))
    hashes = prompt_block_hashes(tokens, B)
    policy.apply_events("w0", [BlockStored(hashes, None, tokens, B, medium="host")])
    policy.apply_events("w1", [BlockStored(hashes, None, tokens, B)])
    r = policy.route(request(tokens), now=0)
    assert r.worker == "w1"
    policy.finish(r.ticket)


def test_consistent_hash_is_stable_and_moves_few_keys():
    policy = fleet("consistent-hash", n=4)
    keys = [str(i) for i in range(400)]
    before = {k: policy.route(request([1], session=k), now=0).worker for k in keys}
    policy.add_worker("w4")
    after = {k: policy.route(request([1], session=k), now=0).worker for k in keys}
    moved = sum(before[k] != after[k] for k in keys)
    assert 0 < moved < len(keys) / 2
    assert all(after[k] in (before[k], "w4") for k in keys)


def test_exclusion_and_an_empty_fleet():
    for name in POLICIES:
        policy = fleet(name, n=2)
        for _ in range(5):
            assert policy.route(request(list(range(40))), now=0, exclude={"w0"}).worker == "w1"
        with pytest.raises(NoWorkerError):
            policy.route(request([1]), now=0, exclude={"w0", "w1"})
        with pytest.raises(NoWorkerError):
            make_policy(name).route(request([1]), now=0)


def test_cache_aware_work_per_request_does_not_grow_with_the_fleet():
    """O(fleet) per request is a known failure mode: time a request at N=8 and N=1000."""

    def per_route(n):
        policy = fleet("cache-aware", n=n)
        system = list(range(256))  # a system prompt every worker holds
        for w in policy.workers:
            policy.apply_events(w, stored(system))
        prompts = [system + conversation(c, 1, 128)[0] for c in range(300)]
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            r = policy.route(request(p), now=i)
            policy.finish(r.ticket)
        return (time.perf_counter() - t0) / len(prompts)

    per_route(8)  # warm up
    small, large = min(per_route(8) for _ in range(3)), min(per_route(1000) for _ in range(3))
    assert large < 3 * small, (small, large)


def test_a_worker_that_leaves_and_returns_starts_with_zero_load():
    policy = fleet("cache-aware", n=2)
    r = policy.route(request(list(range(64))), now=0, exclude={"w1"})
    policy.remove_worker("w0")  # unreachable: out of the fleet with a request in flight
    policy.add_worker("w0", has_events=True)
    policy.finish(r.ticket)  # the old request ends after the worker came back
    assert policy.board.running["w0"] == 0 and policy.board.load("w0") == 0


# Known failure modes of existing routers, each reproduced on simulated workers.


def spread(workers):
    """max / mean requests per worker (1.0: perfectly even)."""
    counts = [workers.count(w) for w in set(workers)]
    return max(counts) / (len(workers) / 4)


def test_leaked_counters_would_pile_requests_on_one_worker_ours_do_not():
    """Load counters not decremented on some path: the worker that took the failed or aborted
    requests looks ever busier (or, with a negative leak, ever idler) and attracts or repels
    everything. After hundreds of requests ending on every path, a burst of new conversations
    still spreads evenly."""
    policy = fleet("cache-aware")
    rng = random.Random(3)
    for i in range(400):
        r = policy.route(request(conversation(1000 + i, 1)[0]), now=i)
        path = rng.choice(("ok", "abort-before-first-token", "fail-and-retry", "abort-mid"))
        if path == "fail-and-retry":  # the worker failed before any byte: retried elsewhere
            policy.finish(r.ticket)
            r = policy.route(request(conversation(1000 + i, 1)[0]), now=i, exclude={r.worker})
        if path != "abort-before-first-token":
            policy.first_token(r.ticket)
        policy.finish(r.ticket, cached_tokens=0 if path == "ok" else None)
    assert all(policy.board.load(w) == 0 for w in policy.workers)
    burst = [policy.route(request(conversation(c, 1)[0]), now=500) for c in range(40)]
    assert spread([r.worker for r in burst]) <= 1.3
    for r in burst:
        policy.finish(r.ticket)


def test_a_burst_sharing_a_system_prompt_does_not_pile_on_its_first_holder():
    """Requests sharing a long system prompt arrive before any event: the approximate entry of
    the first route makes its worker the only holder. Its queued prefill must count against
    it, or every request of the burst would wait on one worker while the others idle."""
    policy = fleet("cache-aware")
    system = list(range(50_000, 50_000 + 1024))
    burst = [policy.route(request(system + conversation(c, 1, 32)[0]), now=0) for c in range(16)]
    assert len({r.worker for r in burst}) == 4
    assert spread([r.worker for r in burst]) <= 1.5
    for r in burst:
        policy.finish(r.ticket)


def test_a_partial_hit_on_a_busy_worker_does_not_outweigh_an_idle_one():
    """The cache-miss fallback must pick an idle worker, and a small cached prefix on a busy
    worker is not worth its queue: cost is uncached tokens + load, so 32 cached tokens do not
    buy a place behind 3,000 tokens of queued prefill."""
    policy = fleet("cache-aware", n=3)
    prefix = list(range(32))
    policy.apply_events("w0", stored(prefix))
    queued = [policy.route(RouteRequest([], 1000), now=0, exclude={"w1", "w2"}) for _ in range(3)]
    policy.route(RouteRequest([], 200), now=0, exclude={"w0", "w2"})  # w1 a little busy
    r = policy.route(request(prefix + list(range(100, 400))), now=1)
    assert r.worker == "w2"  # the idle one, not w0 (the holder) nor w1 (busier)
    for t in queued:
        policy.finish(t.ticket)
    policy.apply_events("w0", stored(prefix + list(range(100, 400))))
    r = policy.route(request(prefix + list(range(100, 420))), now=2)
    assert r.worker == "w0" and r.cached_tokens == 320  # once idle, the prefix wins again


def test_imbalance_gates_per_request_never_fleet_wide():
    """Some routers switch the whole fleet to load balancing once loads diverge, losing every
    conversation's affinity. Ours gates only the overloaded holder: with one worker 10x busier
    than the rest, every conversation homed elsewhere keeps its worker."""
    policy = fleet("cache-aware", n=8)
    homes = home_first_turns(policy, 32)
    hot = homes[0]
    pinned = [
        policy.route(RouteRequest([], 4000), now=1, exclude=set(policy.workers) - {hot})
        for _ in range(10)
    ]
    kept = moved = 0
    for c in range(32):
        r = policy.route(request(conversation(c, 2)[1]), now=2)
        if homes[c] == hot:
            moved += r.worker != hot
        else:
            kept += r.worker == homes[c]
        policy.finish(r.ticket)
    assert kept == sum(h != hot for h in homes.values())  # all of them
    assert moved == sum(h == hot for h in homes.values()) > 0
    for r in pinned:
        policy.finish(r.ticket)


def test_work_per_request_is_bounded_by_the_candidates_not_the_fleet():
    """O(fleet) per request, counted rather than timed: with 1,000 workers all holding the
    same system prompt, one route looks at the load of at most ``candidates`` + 1 workers."""
    policy = fleet("cache-aware", n=1000, candidates=8)
    system = list(range(256))
    for w in policy.workers:
        policy.apply_events(w, stored(system))
    looked = []
    load = policy.board.load
    policy.board.load = lambda w: looked.append(w) or load(w)
    for c in range(20):
        looked.clear()
        r = policy.route(request(system + conversation(c, 1)[0]), now=c)
        assert len(set(looked)) <= 9 and len(looked) <= 20, len(looked)
        assert r.cached_tokens == 256
        policy.finish(r.ticket)


def test_a_prefix_held_by_many_workers_spreads_new_work_over_its_holders():
    """When many workers hold a system prompt, the candidates are drawn among its holders, not
    always the first ones found: with the first eight holders busy (under the load gate) and
    the least-loaded worker not a holder, new conversations go to idle holders and hit."""
    policy = fleet("cache-aware", n=64, candidates=8)
    system = list(range(256))
    holders = policy.workers[32:]  # the least-loaded worker (w0, first in ties) holds nothing
    for w in holders:
        policy.apply_events(w, stored(system))
    busy = []
    for w in holders[:8]:  # one decoding request each: load 32, under the gate
        r = policy.route(RouteRequest([], 64), now=0, exclude=set(policy.workers) - {w})
        policy.first_token(r.ticket)
        busy.append(r)
    chosen = []
    for c in range(40):
        r = policy.route(request(system + conversation(c, 1)[0]), now=1)
        assert r.cached_tokens == 256, "a holder of the system prompt serves it"
        chosen.append(r.worker)
        policy.finish(r.ticket)
    assert not set(holders[:8]) & set(chosen), "an idle holder beats a busy one"
    assert len(set(chosen)) > 8
    for r in busy:
        policy.finish(r.ticket)


@pytest.mark.parametrize("share_ratio", [None, 1.2])
def test_share_ratio_bounds_each_workers_long_run_share(share_ratio):
    """At low utilization every load is zero between requests, so the load gate never fires
    and the two holders of a system prompt would take all of its traffic; the fair-share gate
    caps each worker's routed work near ``share_ratio`` x the fleet's mean."""
    policy = fleet("cache-aware", n=4, gate_tokens=0, share_ratio=share_ratio, share_measure="work")
    system = list(range(512))
    for w in policy.workers[:2]:
        policy.apply_events(w, stored(system))
    for c in range(40):
        r = policy.route(request(system + conversation(c, 1)[0]), now=c)
        policy.first_token(r.ticket)
        policy.finish(r.ticket)
    work = {w: policy.board.work_of(w, now=39) for w in policy.workers}
    mean = sum(work.values()) / len(work)
    if share_ratio is None:
        assert work["w2"] == work["w3"] == 0  # the holders took everything
    else:
        most = max(work.values())
        assert most <= share_ratio * mean + 512 + 64 + 32  # + one request's work
        assert min(work.values()) > 0


def test_share_gate_work_decays_with_its_half_life():
    """Routed work halves every ``work_half_life`` seconds, values stay exact across the
    origin moves that keep the stored scale finite, and the mean decays the same way."""
    board = LoadBoard(decode_weight=0, work_half_life=10.0)
    for w in ("a", "b"):
        board.add_worker(w)
    board.add_work("a", 1000.0, now=5000.0)  # a monotonic clock's origin is arbitrary
    assert board.work_of("a", 5000.0) == pytest.approx(1000.0)
    assert board.work_of("a", 5010.0) == pytest.approx(500.0)
    assert board.mean_work(5020.0) == pytest.approx(125.0)
    assert board.over_share("a", 1.0, 100.0, now=5000.0)
    assert not board.over_share("a", 1.0, 100.0, now=5040.0)  # 62.5 <= 31.25 + 100
    later = 5000.0 + 10.0 * 1000  # a thousand half-lives: the stored scale was rebased
    board.add_work("b", 64.0, now=later)
    assert board.work_of("b", later + 10.0) == pytest.approx(32.0)
    assert board.work_of("a", later) == pytest.approx(0.0, abs=1e-9)


def test_share_gate_forgets_an_old_burst():
    """A holder that took a burst of its prefix's traffic is gated while that work is recent,
    and serves its prefix again once the work has decayed (without decay it never would)."""
    policy = fleet(
        "cache-aware", n=4, share_ratio=1.2, share_half_life=30.0, share_measure="work"
    )  # slack 512
    system = list(range(512))
    policy.apply_events("w1", stored(system))
    policy.board.add_work("w1", 10_000.0, now=0.0)  # w1's burst
    r = policy.route(request(system + conversation(0, 1)[0]), now=1.0)
    assert r.worker != "w1" and r.cached_tokens == 0, "gated while the burst is recent"
    policy.finish(r.ticket)
    r = policy.route(request(system + conversation(1, 1)[0]), now=1000.0)
    assert r.worker == "w1" and r.cached_tokens == 512, "the burst has decayed"
    policy.finish(r.ticket)
