"""The router's prefill/decode policy (``router/pd.py``), pure: simulated workers and events."""

from __future__ import annotations

import random

import pytest

from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.kvevents.types import BlockStored
from radixserve.router.pd import PREFILL_HEADER, PDPolicy
from radixserve.router.policy import PolicyConfig, RouteRequest, make_policy

B = 16


def request(tokens):
    return RouteRequest(prompt_block_hashes(tokens, B), len(tokens))


def stored(tokens):
    return [BlockStored(prompt_block_hashes(tokens, B), None, list(tokens), B)]


def ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def pd(local=64, prefills=2, decodes=2):
    config = PolicyConfig(block_size=B)
    policy = PDPolicy(make_policy("cache-aware", config), make_policy("cache-aware", config), local)
    for i in range(prefills):
        policy.add_prefill(f"p{i}", f"tcp://127.0.0.1:{9000 + i}", has_events=True)
    for i in range(decodes):
        policy.add_worker(f"d{i}", has_events=True)  # the decode set, as WorkerPool does
    return policy


def idle(policy) -> bool:
    """Every load counter of both sets is back to zero."""
    return all(policy.board.load(w) == 0 for w in policy.workers) and all(
        policy.prefill.board.load(w) == 0 for w in policy.prefill.workers
    )


def test_a_long_uncached_prompt_goes_through_the_prefill_instance_holding_its_prefix():
    policy = pd()
    doc = ids(1, 600)
    policy.prefill.apply_events("p1", stored(doc[:512]))  # p1's tree holds most of it
    route = policy.route(request(doc), now=0)
    assert route.prefill is not None and route.prefill.worker == "p1"
    assert route.prefill.cached_tokens == 512
    assert route.headers == {PREFILL_HEADER: "tcp://127.0.0.1:9001"}
    assert policy.board.pending[route.worker] == 0  # the prefill work is not the decode's
    policy.first_token(route.ticket)
    assert policy.prefill.board.load("p1") == 0  # its part ended with the first token
    policy.finish(route.ticket, cached_tokens=0)
    assert idle(policy) and policy.in_flight() == 0


def test_a_turn_whose_history_the_decode_instance_holds_is_prefilled_there():
    policy = pd(local=64)
    history = ids(2, 400)
    policy.apply_events("d0", stored(history))  # decode d0 has the whole history
    turn = history + ids(3, 30)  # the new turn: 30 tokens (< 64) uncached on d0
    route = policy.route(request(turn), now=0)
    assert route.worker == "d0" and route.prefill is None
    assert route.headers == {PREFILL_HEADER: "local"}
    assert policy.pd_stats.local == 1 and policy.pd_stats.split == 0
    policy.finish(route.ticket)
    longer = history + ids(4, 200)  # 200 new tokens: worth a prefill instance
    route = policy.route(request(longer), now=1)
    assert route.worker == "d0" and route.prefill is not None
    policy.finish(route.ticket)
    assert idle(policy)


@pytest.mark.parametrize("first_token", [True, False])
def test_tickets_on_both_sides_end_on_every_path(first_token):
    policy = pd()
    routes = [policy.route(request(ids(i, 300)), now=i) for i in range(6)]
    assert all(r.prefill is not None for r in routes)
    for r in routes:
        if first_token:
            policy.first_token(r.ticket)
        policy.finish(r.ticket)
        policy.finish(r.ticket)  # a second finish is a no-op
    assert idle(policy) and policy.in_flight() == 0


def test_without_a_live_prefill_instance_the_decode_instance_prefills():
    policy = pd(prefills=1)
    policy.remove_prefill("p0")  # its health checks failed
    route = policy.route(request(ids(5, 500)), now=0)
    assert route.prefill is None and route.headers == {PREFILL_HEADER: "local"}
    policy.finish(route.ticket)
    assert idle(policy)


def test_load_spreads_over_prefill_instances_for_unrelated_prompts():
    policy = pd()
    chosen = {policy.route(request(ids(10 + i, 800)), now=i).prefill.worker for i in range(4)}
    assert chosen == {"p0", "p1"}  # the least loaded one takes the next cold prompt
