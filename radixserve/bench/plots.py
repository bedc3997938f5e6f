"""PNG plots of one workload's runs, one line per system.

- ``ttft_cdf``: the empirical CDF of TTFT (log-scaled time axis).
- ``ttft_by_turn``: median TTFT at each turn number (how prefill grows, or not, as a
  conversation's history grows).
- ``hit_rate``: the cumulative cache hit rate (cached over prompt tokens, from ``usage``) as
  requests finish, so every server's curve is measured the same way.

Figures are drawn with ``matplotlib.figure.Figure`` and saved through the Agg canvas: no pyplot
state, no display needed. matplotlib is the ``plot`` extra, imported only when plots are drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from radixserve.bench.loadgen import RunResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PLOTS = ("ttft_cdf", "ttft_by_turn", "hit_rate")
TITLES = {
    "ttft_cdf": "TTFT CDF",
    "ttft_by_turn": "median TTFT by turn",
    "hit_rate": "cache hit rate",
}


def write_plots(
    out_dir: Path, workload: str, results: dict[str, RunResult], summaries: dict[str, dict]
) -> list[Path]:
    """One PNG per plot; ``summaries`` are ``report.summarize`` of each result."""
    from matplotlib.figure import Figure

    paths = []
    for name, draw in (
        ("ttft_cdf", ttft_cdf),
        ("ttft_by_turn", ttft_by_turn),
        ("hit_rate", hit_rate),
    ):
        fig = Figure(figsize=(6.4, 4.2), layout="constrained")
        ax = fig.subplots()
        for system, result in results.items():
            draw(ax, system, result, summaries[system])
        ax.set_title(f"{workload}: {TITLES[name]}")
        ax.grid(True, alpha=0.3)
        if results:
            ax.legend()
        path = out_dir / f"{workload}_{name}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def ttft_cdf(ax: Axes, system: str, result: RunResult, summary: dict) -> None:
    ttft = sorted(r.ttft for r in result.records if r.success and r.ttft is not None)
    if ttft:
        ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=system)
        ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")


def ttft_by_turn(ax: Axes, system: str, result: RunResult, summary: dict) -> None:
    by_turn = summary["ttft_by_turn_p50_s"]
    ax.plot(list(by_turn), list(by_turn.values()), marker="o", label=system)
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT (s)")


def hit_rate(ax: Axes, system: str, result: RunResult, summary: dict) -> None:
    done = sorted(
        (
            r
            for r in result.records
            if r.success and r.cached_tokens is not None and r.prompt_tokens
        ),
        key=lambda r: r.end_time or 0.0,
    )
    times, rates, cached, prompt = [], [], 0, 0
    for r in done:
        cached += r.cached_tokens or 0
        prompt += r.prompt_tokens or 0
        times.append(r.end_time)
        rates.append(cached / prompt)
    ax.plot(times, rates, label=system)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("cumulative cache hit rate")
