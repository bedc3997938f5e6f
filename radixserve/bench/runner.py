"""Run a benchmark plan: every workload on every system, then the reports.

A plan is a list of ``(workload, systems)``. A system named ``base-url`` is the running server
at ``LoadConfig.base_url``; any other is started by ``baselines`` for this workload alone and
stopped after it. A system that cannot be measured (fails to start, refuses requests) is
recorded with its error and the plan goes on; the summary's ``ok`` is False if any system
failed or any request failed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from radixserve.bench import baselines
from radixserve.bench.client import BenchError
from radixserve.bench.loadgen import LoadConfig, run_load
from radixserve.bench.report import SystemRun, WorkloadRuns, write_reports
from radixserve.bench.workloads import Workload

BASE_URL_SYSTEM = "base-url"
HEADLINE = ("requests_ok", "requests_failed", "ttft_p50_s", "ttft_p99_s", "requests_per_s",
            "output_tokens_per_s", "cache_hit_rate", "peak_kv_tokens", "errors")  # fmt: skip


def run_system(
    system: str, workload: Workload, load: LoadConfig, settings: baselines.ServerSettings
) -> SystemRun:
    """Measure ``workload`` on ``system``; a system that cannot run becomes an error entry."""
    label = f"{workload.name}/{system}"
    info: dict[str, Any] = {"url": load.base_url} if system == BASE_URL_SYSTEM else {}
    try:
        if system == BASE_URL_SYSTEM:
            result = run_load(workload, load, label)
        else:
            argv_for_port = baselines.command(system, settings)
            server = baselines.ManagedServer(f"{workload.name}-{system}", argv_for_port, settings)
            info = {"command": server.argv, "log": str(server.log_path), "url": server.base_url}
            if system == "llamacpp":  # what its KV holds; its API does not report usage
                info["kv_capacity_tokens"] = settings.slots * settings.context_length
            with server:
                result = run_load(
                    workload, dataclasses.replace(load, base_url=server.base_url), label
                )
    except BenchError as e:
        print(f"bench: {label}: {e}", file=sys.stderr)
        return SystemRun(system, error=str(e), info=info)
    failed = [r for r in result.records if not r.success]
    if failed:
        print(f"bench: {label}: {len(failed)} requests failed; first: {failed[0].error}",
              file=sys.stderr)  # fmt: skip
    return SystemRun(system, result, info=info)


def run_plan(
    plan: list[tuple[Workload, list[str]]],
    load: LoadConfig,
    settings: baselines.ServerSettings,
    out_dir: Path,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Run every system of every workload, write the reports, return the summary line."""
    groups = [
        WorkloadRuns(workload, [run_system(s, workload, load, settings) for s in systems])
        for workload, systems in plan
    ]
    summaries = write_reports(out_dir, groups, meta)
    line: dict[str, Any] = {"ok": True, "output_dir": str(out_dir), "workloads": {}}
    for group in groups:
        entry = line["workloads"][group.workload.name] = {}
        for run in group.runs:
            if run.error is not None:
                entry[run.name] = {"error": run.error}
                line["ok"] = False
                continue
            summary = summaries[group.workload.name][run.name]
            entry[run.name] = {k: summary[k] for k in HEADLINE}
            line["ok"] = line["ok"] and summary["requests_failed"] == 0
    return line
