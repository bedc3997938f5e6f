"""Reports: per-system summaries, ``results.json``, ``report.md`` and PNG plots.

``summarize`` turns one run into figures. Definitions:

- TTFT, TPOT, ITL and end-to-end percentiles are over successful requests. ``ttft_by_turn`` is
  the median TTFT of the requests at each turn number: the prefill time of turn k in a
  multi-turn workload.
- Throughput: successful requests, and their output tokens (from ``usage``), per second of the
  measured phase (first start to last finish).
- Cache hit rate: the sum of ``cached_tokens`` over the sum of ``prompt_tokens``, over requests
  whose usage reports both; None (``n/a``) when the server reports no cached tokens.
- Peak KV: the largest ``kv_cache_used_tokens`` scraped from ``/metrics`` during the run, also
  in bytes when the server exports ``kv_cache_used_bytes`` or ``kv_cache_bytes_per_token``;
  None (``n/a``) for servers without these metrics (llama.cpp exports none).
- ``server_hit_rate``: growth of ``radix_cache_hit_tokens_total`` over that of
  ``radix_cache_query_tokens_total`` during the run, a cross-check from the server's side.
- ``by_group``: when conversation ids name groups (``chat-3``, ``doc-1``: the part before the
  first ``-``), TTFT and ITL percentiles per group, so the streams of running chats can be
  judged apart from the long prompts that stall them.

``write_reports`` writes the JSON (every record and metric sample), a Markdown table per
workload and three plots per workload (``plots.py``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.bench import plots
from radixserve.bench.loadgen import RunResult
from radixserve.bench.workloads import Workload

REPORT_TURNS = (2, 5)
LEGEND = (
    "TTFT over successful requests; turn-k TTFT is the median TTFT of the requests at turn k "
    "(the prefill time of that turn). Throughput per second of the measured phase. Cache hit "
    "rate: cached / prompt tokens from each response's usage. Peak KV used: the maximum of "
    "`kv_cache_used_tokens` scraped from /metrics (n/a where a server does not export it). "
    "Every record and metric sample is in results.json; server logs are in logs/."
)


@dataclass
class SystemRun:
    name: str
    result: RunResult | None = None
    error: str | None = None  # why the system could not be measured
    info: dict[str, Any] = field(default_factory=dict)  # command, url, log path, capacity


@dataclass
class WorkloadRuns:
    workload: Workload
    runs: list[SystemRun]


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(result: RunResult) -> dict[str, Any]:
    ok = [r for r in result.records if r.success]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        if r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft)
    out = [r.output_tokens for r in ok if r.output_tokens is not None]
    usage = [(r.cached_tokens, r.prompt_tokens) for r in ok]
    usage = [(c, p) for c, p in usage if c is not None and p is not None]
    prompt_total = sum(p for _, p in usage)
    duration = result.duration_s if result.duration_s > 0 else None
    errors = [r.error for r in result.records if not r.success]
    return {
        "requests_sent": len(result.records),
        "requests_ok": len(ok),
        "requests_failed": len(errors),
        "errors": sorted(set(e or "unknown error" for e in errors))[:5],
        "duration_s": result.duration_s,
        **{f"ttft_{name}_s": pct(ttft, q) for name, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_by_turn_p50_s": {t: statistics.median(v) for t, v in sorted(by_turn.items())},
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p99_s": pct(e2e, 99),
        "requests_per_s": len(ok) / duration if duration else None,
        "output_tokens": sum(out) if out else None,
        "output_tokens_per_s": sum(out) / duration if out and duration else None,
        "prompt_tokens": sum(r.prompt_tokens for r in ok if r.prompt_tokens is not None) or None,
        "cache_hit_rate": sum(c for c, _ in usage) / prompt_total if prompt_total else None,
        **kv_figures(result.metrics),
        "by_group": by_group(ok),
    }


def by_group(ok: list) -> dict[str, dict[str, float | None]]:
    groups: dict[str, list] = {}
    for r in ok:
        if "-" in r.conversation_id:
            groups.setdefault(r.conversation_id.split("-", 1)[0], []).append(r)
    if len(groups) < 2:
        return {}
    out = {}
    for name, records in sorted(groups.items()):
        ttft = [r.ttft for r in records if r.ttft is not None]
        itl = [x for r in records for x in r.itl]
        out[name] = {
            "requests": len(records),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50),
            "itl_p99_s": pct(itl, 99),
        }
    return out


def kv_figures(samples: list[dict[str, float]]) -> dict[str, Any]:
    def peak(name: str) -> float | None:
        values = [s[name] for s in samples if name in s]
        return max(values) if values else None

    tokens, used_bytes = peak("kv_cache_used_tokens"), peak("kv_cache_used_bytes")
    per_token = peak("kv_cache_bytes_per_token")
    if used_bytes is None and tokens is not None and per_token is not None:
        used_bytes = tokens * per_token
    queries = [
        s["radix_cache_query_tokens_total"]
        for s in samples
        if "radix_cache_query_tokens_total" in s
    ]
    hits = [
        s["radix_cache_hit_tokens_total"] for s in samples if "radix_cache_hit_tokens_total" in s
    ]
    server_hit_rate = None
    if len(queries) >= 2 and len(hits) == len(queries) and queries[-1] > queries[0]:
        server_hit_rate = (hits[-1] - hits[0]) / (queries[-1] - queries[0])
    return {
        "peak_kv_tokens": int(tokens) if tokens is not None else None,
        "peak_kv_bytes": int(used_bytes) if used_bytes is not None else None,
        "kv_capacity_tokens": _int(peak("kv_cache_capacity_tokens")),
        "server_hit_rate": server_hit_rate,
    }


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _kv(summary: dict[str, Any], info: dict[str, Any]) -> str:
    if summary["peak_kv_bytes"] is not None:
        mib = summary["peak_kv_bytes"] / 2**20
        return f"{mib:.1f} MiB ({summary['peak_kv_tokens']} tok)"
    if summary["peak_kv_tokens"] is not None:
        return f"{summary['peak_kv_tokens']} tok"
    capacity = info.get("kv_capacity_tokens")
    return "n/a" if capacity is None else f"n/a ({capacity} tok allocated)"


def markdown(group: WorkloadRuns, summaries: dict[str, dict[str, Any]]) -> str:
    w = group.workload
    params = ", ".join(f"{k}={v}" for k, v in w.params.items() if v is not None)
    turn_cols = "".join(f" turn-{t} TTFT p50 (ms) |" for t in REPORT_TURNS)
    lines = [
        f"## {w.name}",
        "",
        f"{w.num_requests} requests in {len(w.conversations)} conversations via /v1/"
        f"{'chat/completions' if w.api == 'chat' else 'completions'}; {params}",
        "",
        f"| system | ok/sent | TTFT p50 (ms) | TTFT p99 (ms) |{turn_cols} req/s | output tok/s "
        "| cache hit rate | peak KV used |",
        "|---|---|---|---|" + "---|" * len(REPORT_TURNS) + "---|---|---|---|",
    ]
    for run in group.runs:
        if run.error is not None:
            lines.append(f"| {run.name} | failed: {run.error.splitlines()[0][:120]} |")
            continue
        s = summaries[run.name]
        by_turn = s["ttft_by_turn_p50_s"]
        turns = "".join(f" {_ms(by_turn.get(t))} |" for t in REPORT_TURNS)
        hit = "n/a" if s["cache_hit_rate"] is None else f"{100 * s['cache_hit_rate']:.1f}%"
        lines.append(
            f"| {run.name} | {s['requests_ok']}/{s['requests_sent']} | {_ms(s['ttft_p50_s'])} "
            f"| {_ms(s['ttft_p99_s'])} |{turns} {_num(s['requests_per_s'])} "
            f"| {_num(s['output_tokens_per_s'], 1)} | {hit} | {_kv(s, run.info)} |"
        )
    lines += group_table(group, summaries)
    lines += ["", *(f"![{w.name} {p}]({w.name}_{p}.png)" for p in plots.PLOTS), ""]
    return "\n".join(lines)


def group_table(group: WorkloadRuns, summaries: dict[str, dict[str, Any]]) -> list[str]:
    rows = [
        f"| {run.name} | {name} | {g['requests']} | {_ms(g['ttft_p50_s'])} "
        f"| {_ms(g['ttft_p99_s'])} | {_ms(g['itl_p50_s'])} | {_ms(g['itl_p99_s'])} |"
        for run in group.runs
        if run.name in summaries
        for name, g in summaries[run.name]["by_group"].items()
    ]
    if not rows:
        return []
    head = "| system | group | requests | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) "
    head += "| ITL p99 (ms) |"
    return ["", head, "|---|---|---|---|---|---|---|", *rows]


def write_reports(out_dir: Path, groups: list[WorkloadRuns], meta: dict[str, Any]) -> dict:
    """Write results.json, report.md and the plots; return the summaries by workload, system."""
    out_dir.mkdir(parents=True, exist_ok=True)
    all_summaries: dict[str, dict[str, dict[str, Any]]] = {}
    doc: dict[str, Any] = {"meta": meta, "workloads": {}}
    sections = ["# radixserve bench", "", f"`{meta.get('command', '')}`", "", LEGEND, ""]
    for group in groups:
        w = group.workload
        summaries = {r.name: summarize(r.result) for r in group.runs if r.result is not None}
        all_summaries[w.name] = summaries
        doc["workloads"][w.name] = {
            "api": w.api,
            "params": w.params,
            "num_conversations": len(w.conversations),
            "num_requests": w.num_requests,
            "systems": {r.name: _system_doc(r, summaries.get(r.name)) for r in group.runs},
        }
        sections.append(markdown(group, summaries))
        results = {r.name: r.result for r in group.runs if r.result is not None}
        plots.write_plots(out_dir, w.name, results, summaries)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    (out_dir / "report.md").write_text("\n".join(sections))
    return all_summaries


def _system_doc(run: SystemRun, summary: dict[str, Any] | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"info": run.info, "error": run.error, "summary": summary}
    if run.result is not None:
        doc["model"] = run.result.model
        doc["cache_flushed"] = run.result.cache_flushed
        doc["metrics_available"] = run.result.metrics_available
        doc["records"] = [
            {**dataclasses.asdict(r), "tpot": r.tpot, "end_time": r.end_time}
            for r in run.result.records
        ]
        doc["metrics"] = run.result.metrics
    return doc
