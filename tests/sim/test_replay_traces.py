"""``simulate replay`` on Mooncake-format traces: the shipped trace loads, bad lines are
refused with the line and the fault named, and the replay grid reports every pool size with
the unbounded and Belady reference points and, with ``--ttft``, time to first token at the
trace's own arrival times."""

import gzip
import json

import numpy as np
import pytest

from radixserve.cache.eviction import EVICTION_POLICIES
from radixserve.cli import main
from radixserve.sim.replay import replay, replay_order
from radixserve.sim.trace import TraceError, load_mooncake

MOONCAKE = "tests/sim/fixtures/mooncake_sample.jsonl"
GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def test_the_shipped_trace_loads_with_its_blocks_shared():
    trace = load_mooncake()  # the FAST'25 synthetic trace shipped with radixserve
    assert trace.timed and trace.num_requests == 3993
    arrivals = [s.arrival for s in trace.sessions]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and 1000 < arrivals[-1] < 1100
    order = replay_order(trace)[:200]
    # equal hash ids are equal blocks: an unbounded tree caches each prompt's run of blocks
    # seen before (the last token is always computed); answers are never prompts here
    with gzip.open("radixserve/sim/traces/mooncake_synthetic_trace.jsonl.gz", "rt") as f:
        records = sorted((json.loads(line) for line in f), key=lambda r: r["timestamp"])[:200]
    seen, expected = set(), 0
    for r in records:
        run = next((k for k, h in enumerate(r["hash_ids"]) if h not in seen), len(r["hash_ids"]))
        expected += min(run * 512, r["input_length"] - 1)
        seen.update(r["hash_ids"])
    assert expected > 0 and replay(order, 0, "unbounded").cached_tokens == expected


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2 is not JSON"),
        ("[1, 2]", "line 2 is not a JSON object"),
        (json.dumps({**GOOD, "hash_ids": None}), "hash_ids must be a list of integers"),
        (json.dumps({**GOOD, "hash_ids": ["a", "b"]}), "hash_ids must be a list of integers"),
        (json.dumps({**GOOD, "input_length": True}), "input_length must be a positive integer"),
        (json.dumps({**GOOD, "output_length": 0}), "output_length must be a positive integer"),
        (json.dumps({**GOOD, "timestamp": -5}), "timestamp must be a number of milliseconds"),
        (json.dumps({**GOOD, "timestamp": "soon"}), "timestamp must be a number"),
        (json.dumps({**GOOD, "hash_ids": [1]}), "1 hash_ids for 600 tokens"),
        (json.dumps({"timestamp": 0, "hash_ids": [1]}), "lacks ['input_length', 'output_length']"),
    ],
)
def test_a_bad_line_is_refused_with_its_number_and_fault(tmp_path, line, message):
    for name, opener in (("t.jsonl", open), ("t.jsonl.gz", gzip.open)):
        path = tmp_path / name
        with opener(path, "wt") as f:
            f.write(json.dumps(GOOD) + "\n" + line + "\n")
        with pytest.raises(TraceError, match="line 2") as e:
            load_mooncake(path)
        assert message in str(e.value)


def test_the_cli_names_the_option_and_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**GOOD, "output_length": -1}) + "\n")
    with pytest.raises(SystemExit):
        main(["simulate", "replay", "--trace", f"mooncake:{bad}", "--output-dir",
              str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert "--trace" in err and "line 1" in err and "output_length" in err
    with pytest.raises(SystemExit):
        main(["simulate", "replay", "--trace", MOONCAKE, "--eviction", "lru,clairvoyant",
              "--output-dir", str(tmp_path / "out")])  # fmt: skip
    assert "--eviction: unknown 'clairvoyant'" in capsys.readouterr().err


def small_mooncake(path, requests=300, seed=0):
    """A Mooncake-format trace of short prompts in blocks of 16 tokens: 20 shared heads, each
    request one head and one or two blocks of its own, one arrival every 50 ms."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for j in range(requests):
            own = int(rng.integers(1, 3))
            ids = [int(rng.integers(0, 20)), *range(100 + 2 * j, 100 + 2 * j + own)]
            f.write(json.dumps({"timestamp": 50 * j, "input_length": 16 * len(ids) - 3,
                                "output_length": 4, "hash_ids": ids}) + "\n")  # fmt: skip
    return path


@pytest.mark.slow  # seconds to tens of seconds alone; runs in `make test-all`
def test_replay_reports_every_pool_size_against_belady_and_ttft(tmp_path):
    out = tmp_path / "replay"
    trace = small_mooncake(tmp_path / "t.jsonl")
    code = main(["simulate", "replay", "--trace", f"mooncake:{trace}", "--trace-args",
                 "block_size=16", "--ttft", "--no-plots", "--output-dir", str(out)])  # fmt: skip
    assert code == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    pools = sorted({r["kv_tokens"] for r in rows})
    working_set = rows[0]["working_set_tokens"]
    assert [round(p / working_set, 2) for p in pools] == [0.01, 0.02, 0.05, 0.1, 0.25, 0.4]
    for pool in pools:
        here = {r["policy"]: r for r in rows if r["kv_tokens"] == pool}
        assert set(here) == {*EVICTION_POLICIES, "belady"}
        belady = here["belady"]["hit_rate"]
        for name in EVICTION_POLICIES:
            row = here[name]
            assert row["belady_hit_rate"] == belady
            assert row["vs_belady"] == pytest.approx(row["hit_rate"] / belady)
            assert row["unbounded_hit_rate"] >= belady
            assert row["timed_requests_failed"] == 0
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        if pool >= 0.05 * working_set:  # furthest-next-use is exact for equal sizes only: a
            assert max(here[n]["hit_rate"] for n in EVICTION_POLICIES) <= belady  # tiny pool
        assert "ttft_p50_s" not in here["belady"]  # no timed row: it needs the fixed order
    small, large = (
        {r["policy"]: r for r in rows if r["kv_tokens"] == p}["lru"] for p in (pools[0], pools[-1])
    )
    assert small["timed_hit_rate"] < large["timed_hit_rate"]
    assert small["ttft_p50_s"] > large["ttft_p50_s"]  # a pool that keeps more computes less
