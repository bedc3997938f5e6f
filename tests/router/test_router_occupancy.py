"""The fair-share gate's occupancy measure: seconds each worker had a request in flight, in
the load board, in the cache-aware policy, and in a simulated fleet."""

import argparse
import math

import pytest

from radixserve.config import EngineConfig
from radixserve.kvevents.types import BlockStored
from radixserve.router.cli import add_router_policy_args, policy_config_from_args
from radixserve.router.load import LoadBoard
from radixserve.router.policy import PolicyConfig, RouteRequest, make_policy
from radixserve.sim.loop import SimConfig, Simulation
from radixserve.sim.metrics import summarize
from radixserve.sim.routing import RoutingConfig
from radixserve.sim.timing import TimingModel
from radixserve.sim.workloads import SyntheticSpec, ThinkTime, synthetic_trace

B = 16


def board_of(*workers, half_life=None):
    board = LoadBoard(decode_weight=32, work_half_life=half_life)
    for w in workers:
        board.add_worker(w)
    return board


def test_occupancy_is_the_union_of_the_time_requests_were_in_flight():
    """Two overlapping requests occupy a worker once, not twice; an open interval counts up
    to the time asked about."""
    board = board_of("a", "b")
    board.change("a", running=1, now=100.0)
    board.change("a", running=1, now=102.0)
    board.change("a", running=-1, now=105.0)
    assert board.occupied_of("a", 106.0) == pytest.approx(6.0)  # open since 100
    board.change("a", running=-1, now=107.0)
    assert board.occupied_of("a", 200.0) == pytest.approx(7.0)  # [100, 107]
    assert board.occupied_of("b", 200.0) == 0.0
    board.change("a", running=1)  # no time given: the latest one (107)
    board.change("a", running=-1, now=110.0)
    assert board.occupied_of("a", 200.0) == pytest.approx(10.0)


def test_occupancy_decays_with_the_half_life_and_its_mean_counts_open_intervals():
    board = board_of("a", "b", half_life=10.0)
    board.change("a", running=1, now=1000.0)
    board.change("a", running=-1, now=1008.0)
    assert board.occupied_of("a", 1008.0) == pytest.approx(8.0)
    assert board.occupied_of("a", 1018.0) == pytest.approx(4.0)
    board.change("b", running=1, now=1018.0)
    # at 1020: a holds 8 x 2**-1.2, b an open interval of 2 s (counted whole)
    a = 8.0 * 2**-1.2
    assert board.occupied_of("b", 1020.0) == pytest.approx(2.0)
    assert board.over_occupied_share("a", 1.0, 0.0, 1020.0) == (a > (a + 2.0) / 2)
    assert not board.over_occupied_share("b", 1.0, 0.0, 1020.0)
    later = 1000.0 + 10.0 * 1000  # a thousand half-lives: the stored scale was rebased
    board.change("b", running=-1, now=later)
    assert board.occupied_of("a", later) == pytest.approx(0.0, abs=1e-9)
    assert math.isfinite(board.occupied_of("b", later))


def test_occupancy_gate_allows_count_noise():
    """A worker above the mean by less than ``noise`` standard deviations of Poisson count
    noise (sqrt(mean x seconds per request)) is not over its share; above it, it is."""
    board = board_of("a", "b", "c", "d")
    t = 0.0
    for worker, requests in (("a", 6), ("b", 4), ("c", 3), ("d", 3)):
        for _ in range(requests):  # each request in flight 1 s, one at a time
            board.add_work(worker, 1.0, t)  # what a route records: one request
            board.change(worker, running=1, now=t)
            board.change(worker, running=-1, now=t + 1.0)
            t += 2.0
    # occupancy 6, 4, 3, 3: mean 4, 1 s per request, so one deviation is 2 s
    assert board.over_occupied_share("a", 1.0, 0.0, t)
    assert not board.over_occupied_share("a", 1.0, 1.0, t)  # 6 <= 4 + 2
    assert board.over_occupied_share("a", 1.0, 0.9, t)  # 6 > 4 + 1.8
    assert not board.over_occupied_share("b", 1.0, 0.0, t)


def route_slow_worker_fleet(**config):
    """Every worker holds the prompt; a request lasts 9 s on w0 (long answers there) and 1 s
    elsewhere, one arriving every 10 s, so no load is ever up when a request is routed."""
    policy = make_policy("cache-aware", PolicyConfig(block_size=B, **config), seed=1)
    for i in range(4):
        policy.add_worker(f"w{i}", has_events=True)
    hashes = list(range(1, 33))
    for w in policy.workers:
        policy.apply_events(w, [BlockStored(hashes, None, list(range(32 * B)), B)])
    request = RouteRequest(hashes, 32 * B)
    served = dict.fromkeys(policy.workers, 0)
    for k in range(200):
        now = 10.0 * k
        r = policy.route(request, now)
        policy.first_token(r.ticket, now + 0.1)
        policy.finish(r.ticket, 0, now + (9.0 if r.worker == "w0" else 1.0))
        served[r.worker] += 1
    return policy, served, 10.0 * 200


def test_occupancy_gate_sends_less_to_a_worker_whose_requests_run_long():
    """Routed work (tokens + decode_weight per request) is the same whatever the answer
    length, so the work gate deals requests evenly; the occupancy gate sees that w0's
    requests run 9 times as long and gives it about as much time as the others."""
    _, by_work, _ = route_slow_worker_fleet(share_ratio=1.05, gate_tokens=0, share_measure="work")
    assert max(by_work.values()) - min(by_work.values()) <= 2
    policy, by_time, end = route_slow_worker_fleet(
        share_ratio=1.05, gate_tokens=0, share_measure="occupancy", share_noise=0.0
    )
    assert by_time["w0"] < min(by_time[w] for w in ("w1", "w2", "w3")) / 4
    occupied = {w: policy.board.occupied_of(w, end) for w in policy.workers}
    mean = sum(occupied.values()) / 4
    assert occupied["w0"] <= 1.05 * mean + 9.0  # + the one request that crossed the line


def test_share_measure_and_noise_are_validated():
    with pytest.raises(ValueError, match="share_measure"):
        PolicyConfig(share_measure="tokens")
    with pytest.raises(ValueError, match="share_noise"):
        PolicyConfig(share_noise=-1.0)


OCCUPANCY_GATE = {
    "share_ratio": 1.05,
    "share_measure": "occupancy",
    "share_noise": 1.0,
    "share_half_life": 600.0,
}


def fleet_run(gate):
    """benchmarks/fleet/sim_fleet.py's workload at N = 2 (180 requests) on the shipped profile."""
    n = 2
    spec = SyntheticSpec(num_sessions=n * 100 // 3, num_system_prompts=4,
                         session_rate=0.02 * n, think_time=ThinkTime(20.0))  # fmt: skip
    trace = synthetic_trace(spec, 0).head(n * 100)
    engine = EngineConfig.from_options(
        max_total_tokens=20_000, chunked_prefill_size=256, load_progress=False
    )
    routing = RoutingConfig("cache-aware", policy_args=gate)
    result = Simulation(trace, SimConfig(engine, n, routing), TimingModel.load("cpu-smollm2-135m"))
    return summarize(result.run())


def test_occupancy_gate_balances_a_simulated_fleet_and_keeps_its_hit_rate():
    """The fleet benchmark's workload at N = 2: with the gate off the holder of the most
    popular system prompt does most of the work; the occupancy gate evens busy time out and
    gives up little of the hit rate."""
    off, on = fleet_run({"share_ratio": None}), fleet_run(OCCUPANCY_GATE)
    assert off["load_imbalance_busy"] > 1.5
    assert on["load_imbalance_busy"] < 1.2
    assert on["hit_rate"] > 0.95 * off["hit_rate"]


def test_router_flags_set_the_gate_and_turn_it_off():
    parser = argparse.ArgumentParser()
    add_router_policy_args(parser)

    def config(*argv):
        return policy_config_from_args(parser, parser.parse_args(list(argv)))

    assert config().share_ratio == PolicyConfig().share_ratio
    assert config("--share-ratio", "off").share_ratio is None
    c = config("--share-ratio", "1.2", "--share-measure", "work", "--share-noise", "2")
    assert (c.share_ratio, c.share_measure, c.share_noise) == (1.2, "work", 2.0)
    with pytest.raises(SystemExit):
        config("--share-measure", "tokens")  # a clear parser error, not a traceback
