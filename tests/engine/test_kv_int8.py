"""``kv_cache_dtype int8`` and ``kv_tier_dtype int8`` through the engine, on the tiny model.

Every path (a whole prompt, chunks, a cache hit, decode) reads the same rounded KV from the
pool, so an int8 engine's greedy output is the same with the prefix cache on or off and in
chunks; pages that went to the host tier and came back give the same output again (int8
pages move bit for bit); the pool holds 3.6x the tokens of float32 in the same bytes.
(Agreement with float KV is measured on a real model: ``tests/model/test_kv_int8_real.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest

from radixserve import LLM, SamplingParams
from radixserve.cache.kv_format import KVFormat

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    head = rng.integers(100, 40000, shared).tolist()
    return [head + rng.integers(100, 40000, int(rng.integers(20, 80))).tolist() for _ in range(n)]


def generate(engine, batch, params=GREEDY) -> list[list[int]]:
    outs = LLM.from_engine(engine).generate(batch, params)
    engine.check_integrity()
    return [o.token_ids for o in outs]


def test_int8_pool_paths_agree_and_hold_more_tokens(make_engine):
    batch = prompts(6, seed=1, shared=50)
    whole = make_engine(kv_cache_dtype="int8", enable_prefix_caching=False)
    assert whole.pool.format.name == "int8g16" and whole.info().kv_format == "int8g16"
    ref = generate(whole, batch)
    cached = make_engine(kv_cache_dtype="int8", chunked_prefill_size=16)
    assert generate(cached, batch) == ref
    assert generate(cached, batch) == ref  # every prompt a cache hit now
    floats = make_engine(max_total_tokens=whole.pool.num_slots)
    assert whole.pool.nbytes() * 3.5 < floats.pool.nbytes()


@pytest.mark.parametrize("device_dtype", ["int8", "auto"])
def test_pages_back_from_the_int8_host_tier_give_the_same_output(make_engine, device_dtype):
    """A small device pool, a host tier of int8 pages: a prompt evicted to the host and
    loaded back gives the output it gave before (with a float device pool, the output of
    its KV rounded to int8, computed again after the first load)."""
    engine = make_engine(
        kv_cache_dtype=device_dtype, kv_tier_dtype="int8", max_total_tokens=256,
        host_kv_memory=4 << 20, page_size=4, write_policy="write_through",
    )  # fmt: skip
    int8_bytes = engine.pool.shape.with_format(KVFormat.of("int8")).bytes_per_token()
    assert engine.stats().tiers.host_bytes_per_token == int8_bytes
    first = prompts(1, seed=3)[0][:60]
    others = prompts(6, seed=4)
    out1 = generate(engine, [first])
    generate(engine, others)  # push the first prompt's pages out of the device pool
    loads = engine.stats().tiers.pages_to_device
    out2 = generate(engine, [first])
    assert engine.stats().tiers.pages_to_device > loads  # it came back from the host
    if device_dtype == "int8":
        assert out2 == out1
    else:  # float32 on the device, 3.6x fewer bytes per token on the host
        assert engine.pool.shape.bytes_per_token() > 3.5 * int8_bytes
    generate(engine, others)
    assert generate(engine, [first]) == out2
