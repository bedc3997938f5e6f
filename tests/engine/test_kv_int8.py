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
from radixserve.config import EngineConfig

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


def test_float_layers_paths_agree_and_hold_their_bytes(make_engine):
    """Layer 0 kept in float32 (``kv_float_layers``): prefill, chunks, cache hits and native
    decode read the same pool, so the output does not depend on the path."""
    batch = prompts(6, seed=5, shared=40)
    whole = make_engine(kv_cache_dtype="int8", kv_float_layers="0", enable_prefix_caching=False)
    shape = whole.pool.shape
    assert shape.float_layers == (0,) and whole.info().kv_format == "int8g16+float32@0"
    assert whole.pool.fk.dtype == whole.model.dtype
    ref = generate(whole, batch)
    cached = make_engine(kv_cache_dtype="int8", kv_float_layers="0", chunked_prefill_size=16)
    assert generate(cached, batch) == ref
    assert generate(cached, batch) == ref  # every prompt a cache hit now
    int8 = shape.with_format(KVFormat.of("int8"))
    float_layer = 2 * shape.num_kv_heads * shape.head_dim * whole.pool.fk.element_size()
    assert shape.bytes_per_token() == int8.bytes_per_token() - int8.layer_bytes() + float_layer
    assert whole.pool.nbytes() == whole.pool.num_slots * shape.bytes_per_token()
    none = make_engine(kv_cache_dtype="int8", kv_float_layers="none")
    assert none.pool.shape.float_layers == () and generate(none, batch) != ref


def test_float_layers_through_the_host_and_storage_tiers(make_engine, tmp_path):
    """A small device pool over int8 host pages and a file store: a prompt evicted and
    loaded back (its float layer as int8 rows decode) gives the same output on every load."""
    engine = make_engine(
        kv_cache_dtype="int8", kv_float_layers="0", max_total_tokens=256, page_size=4,
        host_kv_memory=4 << 20, kv_storage=str(tmp_path), write_policy="write_through",
    )  # fmt: skip
    int8_bytes = engine.pool.shape.with_format(KVFormat.of("int8")).bytes_per_token()
    assert engine.stats().tiers.host_bytes_per_token == int8_bytes
    first = prompts(1, seed=3)[0][:60]
    others = prompts(6, seed=4)
    generate(engine, [first])
    generate(engine, others)  # push the first prompt's pages out of the device pool
    loads = engine.stats().tiers.pages_to_device
    out2 = generate(engine, [first])
    assert engine.stats().tiers.pages_to_device > loads  # it came back from the host
    generate(engine, others)
    assert generate(engine, [first]) == out2


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"kv_cache_dtype": "int8", "kv_float_layers": "first"}, "kv_float_layers must be"),
        ({"kv_cache_dtype": "int8", "kv_float_layers": "0,-1"}, "kv_float_layers must be"),
        ({"kv_float_layers": "0"}, "kv_float_layers .* needs kv_cache_dtype int8"),
    ],
)
def test_bad_float_layers_are_refused_by_name(options, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_options(**options)


def test_float_layers_past_the_model_are_refused_by_name(make_engine):
    with pytest.raises(ValueError, match="kv_float_layers '0,99': the model has layers"):
        make_engine(kv_cache_dtype="int8", kv_float_layers="0,99")


def test_float_layers_flag_is_a_cli_error_naming_it(capsys):
    from radixserve.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--kv-cache-dtype", "int8", "--kv-float-layers", "first"])
    assert "--kv-float-layers" in capsys.readouterr().err
