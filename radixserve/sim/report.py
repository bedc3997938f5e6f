"""Writing a simulation's results: one JSON file, a Markdown table, and line plots.

A run of ``radixserve simulate`` (or ``simulate replay``) is a grid of configurations; each
configuration gives one row (a flat dict). ``write_report`` writes ``results.json`` (the
command, the trace, the timing model, every row), ``report.md`` (the rows as a table) and,
where the grid varies it, one plot per x axis: hit rate against KV tokens (one curve per
eviction policy or design) and hit rate against instance count (one curve per routing
policy). Curves are grouped by every other column that varies, so no two settings share one.
Figures are drawn on ``matplotlib.figure.Figure`` (no pyplot state, no display); matplotlib is
the ``plot`` extra, imported only when a plot is drawn.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from radixserve.sim.metrics import finite

PLOTS = {
    # x column: (file name, x label, log x)
    "kv_tokens_per_instance": ("hit_rate_vs_kv_tokens.png", "KV tokens per instance", True),
    "kv_tokens": ("hit_rate_vs_kv_tokens.png", "KV tokens", True),
    "instances": ("hit_rate_vs_instances.png", "instances", True),
}
# Columns that name a configuration (the rest are measurements).
SETTINGS = ("trace", "design", "policy", "eviction_policy", "routing", "instances",
            "kv_tokens", "kv_tokens_per_instance", "page_size", "schedule_policy")  # fmt: skip
TABLE = ("hit_rate", "vs_belady", "prefill_tokens_saved", "ttft_p50_s", "ttft_p99_s",
         "latency_p50_s", "requests_per_s", "load_imbalance_busy", "load_imbalance_requests",
         "evicted_tokens", "requests", "requests_failed", "wall_s", "cpu_s")  # fmt: skip


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def varying(rows: list[dict[str, Any]], columns) -> list[str]:
    return [c for c in columns if len({json.dumps(r.get(c), default=str) for r in rows}) > 1]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    settings = [c for c in SETTINGS if any(c in r for r in rows)]
    measures = [c for c in TABLE if any(c in r for r in rows)]
    head = settings + measures
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in head) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], x: str, path: Path, label: str, log_x: bool) -> Path:
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    series_cols = [c for c in varying(rows, SETTINGS) if c != x]
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r.get("hit_rate") is None:
            continue
        name = ", ".join(f"{r.get(c)}" for c in series_cols if c in r) or "hit rate"
        curves[name].append((r[x], 100 * r["hit_rate"]))
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for name, points in sorted(curves.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    if log_x:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel(label)
    ax.set_ylabel("cache hit rate (% of prompt tokens)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def write_report(
    out_dir: Path, title: str, rows: list[dict[str, Any]], meta: dict[str, Any], plots: bool = True
) -> dict[str, Any]:
    """Write everything; return ``{"output_dir", "json", "markdown", "plots"}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = [{k: finite(v) for k, v in r.items()} for r in rows]
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps({**meta, "rows": clean}, indent=2, default=str) + "\n")
    written = []
    if plots:
        for x, (name, label, log_x) in PLOTS.items():
            if x in varying(rows, (x,)):
                written.append(plot(rows, x, out_dir / name, label, log_x))
    md = [f"# {title}", "", f"Command: `{meta.get('command', '')}`", "", markdown_table(clean)]
    md += [f"\n![{p.stem}]({p.name})" for p in written]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(md) + "\n")
    return {"output_dir": str(out_dir), "json": str(json_path), "markdown": str(md_path),
            "plots": [str(p) for p in written]}  # fmt: skip
