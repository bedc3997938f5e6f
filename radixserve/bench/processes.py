"""Child processes of the fleet tests and benchmarks: ``radixserve`` servers and routers on
free loopback ports (``Proc``), and their ``/metrics`` read as a dict (``read_metrics``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx


class Proc:
    """A ``radixserve`` child process; ``url`` once it printed its listening line."""

    def __init__(self, args: list[str], marker: str):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.cli", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        self.args, self.marker = args, marker
        self.lines: list[str] = []
        self.url = None

    def wait(self, timeout: float = 240.0) -> Proc:
        args, marker = self.args, self.marker
        deadline = time.monotonic() + timeout
        while self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError(f"{args[0]} exited:\n" + "".join(self.lines[-30:]))
            self.lines.append(line)
            if line.startswith(marker):
                self.url = line.split()[len(marker.split())]
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[0]} did not start:\n" + "".join(self.lines[-30:]))
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(20)


def read_metrics(url: str, headers: dict[str, str]) -> dict[str, float]:
    """The samples of ``/metrics``: name -> value, keyed ``name{label=value,...}`` where they
    have labels other than ``model_name`` (``draft_accepted_tokens_total{source=text}``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", headers=headers).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
