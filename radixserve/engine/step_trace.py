"""The step trace: what a serving engine computed at each step, and when, as JSON lines.

Written by the engine process of ``radixserve serve --step-trace PATH`` (off by default: no
cost when off), read by ``radixserve simulate fit --server`` to measure the engine as it runs
behind the HTTP front end (``sim/served.py``). Each line is one object; times are
``time.monotonic()`` seconds, one clock for every process of the machine:

    {"add": request_id, "sent": t, "received": t}
        a request reached the engine: ``sent`` when the HTTP process sent it (what a simulator
        calls its arrival), ``received`` when the engine loop read it (between two steps)
    {"step": [start, end], "prefills": [[tokens, position], ...], "decodes": [context, ...],
     "first": [request_id, ...], "finished": [request_id, ...]}
        one engine step, timed whole by the loop (scheduling, forward, sampling, sending the
        outputs): the prompt chunks it computed (``tokens`` from context ``position``), the
        context length of each request it decoded, the requests that got their first token
        and those that finished in it

A line is written as soon as it is known (line-buffered), so a trace read while the server
runs is whole up to its last line. ``read_step_trace`` turns a file into ``StepTrace``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


@dataclass
class TierTrace:
    """The tier moves of one step: deltas of the tiers' counters (``TierStats``)."""

    loads: int = 0
    loaded_tokens: int = 0
    load_s: float = 0.0
    backed_up_tokens: int = 0
    backup_s: float = 0.0
    pages_to_storage: int = 0
    pages_from_storage: int = 0
    storage_reads_out: int = 0  # a gauge: reads not answered at the step's end
    lookup_wait_s: float = 0.0  # the step's start waiting for storage lookups

    @classmethod
    def between(cls, before: Any, after: Any) -> TierTrace:
        """From two ``TierStats`` snapshots (before and after the step)."""
        per_token = max(after.host_bytes_per_token, 1)
        return cls(
            loads=after.loads - before.loads,
            loaded_tokens=(after.bytes_to_device - before.bytes_to_device) // per_token,
            load_s=after.load_latency.total - before.load_latency.total,
            backed_up_tokens=(after.bytes_to_host - before.bytes_to_host) // per_token,
            backup_s=after.backup_seconds - before.backup_seconds,
            pages_to_storage=after.pages_to_storage - before.pages_to_storage,
            pages_from_storage=after.pages_from_storage - before.pages_from_storage,
            storage_reads_out=after.prefetches_in_flight,
            lookup_wait_s=after.lookup_wait_seconds - before.lookup_wait_seconds,
        )


class StepTraceWriter:
    """Appends trace lines to ``path`` (created; an existing file is extended)."""

    def __init__(self, path: str | Path):
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 (closed by close())

    def added(self, request_id: str, sent: float | None, received: float) -> None:
        self._write({"add": request_id, "sent": sent, "received": received})

    def step(
        self,
        start: float,
        end: float,
        prefills: list[tuple[int, int]],
        decodes: list[int],
        first: list[str],
        finished: list[str],
        tiers: TierTrace | None = None,
    ) -> None:
        entry = {"step": [start, end], "prefills": prefills, "decodes": decodes,
                 "first": first, "finished": finished}  # fmt: skip
        if tiers is not None:
            entry["tiers"] = dataclasses.asdict(tiers)
        self._write(entry)

    def _write(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


@dataclass
class TracedStep:
    start: float
    end: float
    prefills: list[tuple[int, int]]
    decodes: list[int]
    tiers: TierTrace | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class TracedRequest:
    sent: float  # arrival at the engine's inbox (the HTTP side's clock)
    received: float
    first_token: float | None = None  # end of the step that produced it
    finished: float | None = None


@dataclass
class StepTrace:
    steps: list[TracedStep] = field(default_factory=list)
    requests: dict[str, TracedRequest] = field(default_factory=dict)


def read_step_trace(path: str | Path) -> StepTrace:
    """Parse a trace file; a torn last line (the server still writing) is skipped."""
    trace = StepTrace()
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "add" in entry:
                received = float(entry["received"])
                sent = entry.get("sent")
                trace.requests[entry["add"]] = TracedRequest(
                    received if sent is None else float(sent), received
                )
            elif "step" in entry:
                start, end = entry["step"]
                prefills = [(int(n), int(p)) for n, p in entry["prefills"]]
                tiers = TierTrace(**entry["tiers"]) if "tiers" in entry else None
                trace.steps.append(TracedStep(start, end, prefills, list(entry["decodes"]), tiers))
                for rid in entry["first"]:
                    if rid in trace.requests and trace.requests[rid].first_token is None:
                        trace.requests[rid].first_token = end
                for rid in entry["finished"]:
                    if rid in trace.requests:
                        trace.requests[rid].finished = end
    return trace
