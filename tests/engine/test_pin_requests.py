"""Requests' pins in the engine (tiny model): a prefix is pinned once computed and survives
the load that evicts everything else, pins expire on the engine's pin clock, a pinned
prefix with a host tier is demoted there when a newer pin needs the budget, and a request
that could never run beside the pins makes them give way instead of waiting for ever."""

from __future__ import annotations

from radixserve.engine.sampling_params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def run(engine, rid: str, prompt: list[int], **options) -> None:
    engine.add_request(rid, prompt, ONE, **options)
    for _ in range(500):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError(f"{rid} did not finish")


def seq(start: int, n: int) -> list[int]:
    return [(start + i) % 250 + 3 for i in range(n)]


def cached(engine, prompt: list[int]) -> int:
    return engine.cache.match_prefix(prompt, record_stats=False).device_len


def test_a_pinned_prefix_outlives_the_load_and_expires_on_the_clock(make_engine):
    engine = make_engine(max_total_tokens=768, pin_budget=0.5)
    now = [0.0]
    engine.pins.clock = lambda: now[0]
    system, other = seq(0, 250), seq(100, 250)
    run(engine, "pinned", system + seq(7, 20), pins=((250, 60.0),), tenant="a")
    run(engine, "plain", other + seq(9, 20))
    for i in range(8):  # 8 x 150 new tokens through a 768-slot pool
        run(engine, f"load{i}", [(i * 37 + j * 11) % 250 + 3 for j in range(150)])
    assert cached(engine, system) == 250 and cached(engine, other) < 250
    stats = engine.stats().pins
    assert stats.pinned_tokens == 250 and stats.tenant_tokens == {"a": 250}
    now[0] = 61.0
    assert engine.stats().pins.pins == 0 and engine.stats().pins.expired == 1
    for i in range(6):
        run(engine, f"after{i}", [(i * 41 + j * 13) % 250 + 3 for j in range(150)])
    assert cached(engine, system) < 250  # unpinned: evicted like the rest


def test_a_request_too_big_beside_the_pins_makes_them_give_way(make_engine):
    engine = make_engine(max_total_tokens=512, pin_budget=0.9)
    run(engine, "pin", seq(0, 400), pins=((400, 3600.0),))
    assert engine.stats().pins.pinned_tokens == 400
    run(engine, "big", seq(50, 300))  # needs 301 slots; 112 are not pinned
    assert engine.stats().pins.pins == 0 and engine.stats().pins.demoted == 1


def test_over_budget_the_older_pin_is_demoted_to_the_host_tier(make_engine):
    engine = make_engine(max_total_tokens=768, pin_budget=0.4, host_kv_memory="64MiB")
    first, second = seq(0, 200), seq(120, 200)
    run(engine, "first", first, pins=((200, 600.0),))
    run(engine, "second", second, pins=((200, 600.0),))  # 400 > 307: the first goes
    stats = engine.stats().pins
    assert stats.demoted == 1 and stats.demoted_to_host == 1 and stats.pins == 1
    match = engine.cache.match_prefix(first, record_stats=False)
    assert match.device_len + match.host_len >= 199
