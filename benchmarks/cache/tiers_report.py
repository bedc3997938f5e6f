"""The hierarchical-cache benchmark's tables (``bench_tiers.py``): one row per system, the
median of its rounds when it ran several times (alternated with the other systems)."""

from __future__ import annotations

import json
import statistics


def _median_row(runs: list[dict]) -> dict:
    """The median of every figure over ``runs`` of one system (hit rates too: they vary a
    little with the order requests were admitted in)."""
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    turns = runs[0]["ttft_turn_median_s"]
    return {
        "system": runs[0]["system"],
        "rounds": len(runs),
        "req_per_s": med("req_per_s"),
        "ttft_p50_s": med("ttft_p50_s"),
        "ttft_p99_s": med("ttft_p99_s"),
        "hit_rate": med("hit_rate"),
        "ttft_turn_median_s": {
            t: statistics.median(r["ttft_turn_median_s"][t] for r in runs) for t in turns
        },
        "hits_by_tier": {
            t: statistics.median(r["hits_by_tier"][t] for r in runs)
            for t in ("device", "host", "storage")
        },
    }


def summarize(rows: list[dict]) -> list[dict]:
    """One row per system, in the order they first ran."""
    by_system: dict[str, list[dict]] = {}
    for r in rows:
        by_system.setdefault(r["system"], []).append(r)
    return [_median_row(runs) for runs in by_system.values()]


def print_tables(out: dict) -> None:
    if "systems" in out:
        print_systems(summarize(out["systems"]))
        for r in out["systems"]:
            st, cpu = r.get("step_time", {}), r.get("cpu", {})
            print(f"  {r['system']} round {r['round']}: {r['req_per_s']:.2f} req/s, p50 "
                  f"{r['ttft_p50_s']:.2f} s, p99 {r['ttft_p99_s']:.2f} s; steps "
                  f"{st.get('step_s', 0):.1f} s, prefill {st.get('prefill_tokens', 0)} tok, "
                  f"loaded {st.get('loaded_tokens', 0)} tok in {st.get('load_s', 0):.2f} s; "
                  f"CPU engine main {cpu.get('engine_main_s', 0):.1f} s, other threads "
                  f"{cpu.get('engine_threads_s', 0):.1f} s ({cpu.get('engine_threads', 0)}), "
                  f"front end {cpu.get('front_end_s', 0):.1f} s")  # fmt: skip
    if out.get("warm_restart"):
        w = out["warm_restart"]
        print(f"\nwarm restart: turn TTFT p50 {w['warm'] * 1000:.0f} ms "
              f"(cached {w['warm_cached']:.0%}) vs cold {w['cold'] * 1000:.0f} ms "
              f"(cached {w['cold_cached']:.0%}): {w['speedup']:.2f}x")  # fmt: skip
    if out.get("page_costs"):
        print("\n" + json.dumps(out["page_costs"], indent=1))


def turn2(row: dict) -> float:
    """The median TTFT of turn 2 (keys are ints, or strings once read back from JSON)."""
    turns = {str(t): v for t, v in row["ttft_turn_median_s"].items()}
    return turns.get("2", 0.0)


def print_systems(rows: list[dict]) -> None:
    named = {r["system"]: r for r in rows}
    base, dev = named.get("unbounded"), named.get("device-only")
    turns = list(rows[0]["ttft_turn_median_s"])
    print(
        "\n| system | req/s | TTFT p50 | TTFT p99 | "
        + " | ".join(f"turn {t} median" for t in turns)
        + " | hit rate | of which device / host / storage | vs unbounded |"
    )
    print("|---" * (7 + len(turns)) + "|")
    for r in rows:
        t = r["hits_by_tier"]
        cells = [
            r["system"],
            f"{r['req_per_s']:.2f}",
            f"{r['ttft_p50_s']:.2f} s",
            f"{r['ttft_p99_s']:.2f} s",
            *(f"{v:.2f} s" for v in r["ttft_turn_median_s"].values()),
            f"{r['hit_rate']:.3f}",
            " / ".join(f"{t[k]:.1%}" for k in ("device", "host", "storage")),
            f"{r['hit_rate'] / base['hit_rate']:.3f}" if base else "-",
        ]
        print("| " + " | ".join(cells) + " |")
    if dev:
        print("\nvs device-only (TTFT p50, turn-2 median, TTFT p99, req/s):")
        for r in rows:
            t2 = turn2(r) / max(turn2(dev), 1e-9)
            print(f"  {r['system']}: {r['ttft_p50_s'] / dev['ttft_p50_s']:.2f}x, {t2:.2f}x, "
                  f"{r['ttft_p99_s'] / dev['ttft_p99_s']:.2f}x, "
                  f"{r['req_per_s'] / dev['req_per_s']:.2f}x")  # fmt: skip
