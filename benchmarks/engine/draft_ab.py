"""Drafts on against off, one server per setting: the part ``bench_spec_bench`` and
``bench_agent_session`` share (no command of its own).

- ``SYSTEMS``: the draft settings compared, each a radixserve server with those flags:
  ``defaults`` (no draft flag: what a user gets), ``none`` (``--draft-sources none``) and
  ``all`` (``--draft-sources grammar,text,cache``).
- ``start_servers``: every chosen setting on its own free loopback port, same GGUF file, same
  threads (``OMP_NUM_THREADS`` too, which the engine inherits), one request at a time.
- ``Server.chat``: one non-streamed ``/v1/chat/completions`` request, greedy, no repetition
  penalty (Qwen2.5's generation config asks for 1.05, which radixserve applies to requests
  that set none, and a penalised request never drafts), timed by the server itself: the
  growth of its ``time_to_first_token_seconds`` and ``e2e_request_latency_seconds`` sums
  over the request (one request at a time, so the growth is this request's). A tool call
  under a grammar arrives whole at the end, so a client's clock could not split prefill from
  decode; the server's can. Decode seconds are ``e2e - ttft``; a request's decode tokens are
  ``completion_tokens - 1`` (the first token belongs to the prefill).
- ``Tally``: decode tokens and seconds summed, and the draft counters' growth per source
  (proposed, kept), so a group of requests has its decode tokens/s and acceptance, and the
  speed-up those counts give under a cost model of rows (``Tally.modelled``), a figure that a
  busy machine's noise does not move.
- ``rotated``: the settings in a rotated order per item, so a drift of a shared machine's
  speed hits every setting alike.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench import baselines
from radixserve.bench.processes import read_metrics

SYSTEMS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "none": ("--draft-sources", "none"),
    "all": ("--draft-sources", "grammar,text,cache"),
}
TTFT_SUM = "time_to_first_token_seconds_sum"
E2E_SUM = "e2e_request_latency_seconds_sum"
WARMUP = [{"role": "user", "content": "Say this line twice: " + "the quick brown fox jumps over "
            "the lazy dog while seven wizards quietly box"}]  # fmt: skip
SETTLE_S = 0.05  # the engine's stats snapshot (draft counters) follows the last token
BETAS = (0.1, 0.2, 0.35)  # a row's share of a one-row step: the policy's default to kernels alone


@dataclass
class Tally:
    tokens: int = 0  # decode tokens (each request's output less its first token)
    seconds: float = 0.0  # decode seconds
    proposed: dict[str, float] = field(default_factory=dict)  # draft tokens computed, by source
    accepted: dict[str, float] = field(default_factory=dict)  # of which kept

    def add(self, other: Tally) -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        for mine, theirs in ((self.proposed, other.proposed), (self.accepted, other.accepted)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        acceptance = {
            s: round(self.accepted.get(s, 0.0) / n, 3) for s, n in self.proposed.items() if n
        }
        return {"decode_tokens_per_s": round(self.rate, 2), "decode_tokens": self.tokens,
                "draft_proposed": {k: int(v) for k, v in self.proposed.items() if v},
                "draft_acceptance": acceptance,
                "modelled_vs_none": self.modelled()}  # fmt: skip

    def modelled(self) -> dict[str, float]:
        """The speed-up over no drafts that these counts give if a step of ``r`` rows costs
        ``1 + beta * (r - 1)`` one-row steps, for a few ``beta``: a figure from counts alone,
        which a busy machine does not blur. Each step writes one token plus the draft tokens
        it kept, and computes a row per draft token besides."""
        kept, proposed = sum(self.accepted.values()), sum(self.proposed.values())
        steps = self.tokens - kept
        if steps <= 0:
            return {}
        return {f"beta_{b}": round(self.tokens / (steps + b * proposed), 3) for b in BETAS}


def _draft_counters(metrics: dict[str, float], name: str) -> dict[str, float]:
    prefix = f"{name}_total{{source="
    return {k[len(prefix) : -1]: v for k, v in metrics.items() if k.startswith(prefix)}


@dataclass
class Server:
    name: str
    url: str
    model: str = ""
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=3600.0))

    def chat(self, messages: list[dict], max_tokens: int, **extra: Any) -> tuple[dict, Tally]:
        """One greedy chat request (``extra``: more body fields, e.g. ``tools``): the
        response's message and this request's ``Tally``."""
        before = read_metrics(self.url, {})
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, "repetition_penalty": 1.0, **extra}  # fmt: skip
        r = self.client.post(f"{self.url}/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {r.text[:500]}")
        time.sleep(SETTLE_S)
        after = read_metrics(self.url, {})
        out = r.json()
        grew = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (TTFT_SUM, E2E_SUM)}
        tally = Tally(max(0, out["usage"]["completion_tokens"] - 1), grew[E2E_SUM] - grew[TTFT_SUM])
        for counter, into in (("draft_proposed_tokens", tally.proposed),
                              ("draft_accepted_tokens", tally.accepted)):  # fmt: skip
            old = _draft_counters(before, counter)
            for source, v in _draft_counters(after, counter).items():
                into[source] = v - old.get(source, 0.0)
        return out["choices"][0]["message"], tally


def start_servers(
    stack: contextlib.ExitStack,
    names: list[str],
    model: str,
    threads: int,
    context_length: int,
    extra: tuple[str, ...] = (),
) -> dict[str, Server]:
    """Start a server per setting in ``names`` (closed with ``stack``); warm each up."""
    for name in names:
        if name not in SYSTEMS:
            raise SystemExit(f"--systems: unknown {name!r}; choose from {', '.join(SYSTEMS)}")
    from radixserve.model.loader import resolve_model_path

    path = str(resolve_model_path(model))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-drafts-"))  # the servers' logs stay there
    base = baselines.ServerSettings(model=path, slots=1, context_length=context_length,
                                    threads=threads, log_dir=log_dir)  # fmt: skip
    servers = {}
    for name in names:
        settings = dataclasses.replace(base, radix_args=(*extra, *SYSTEMS[name]))
        managed = baselines.ManagedServer(
            f"drafts-{name}", baselines.command("radix", settings), settings
        )
        stack.enter_context(managed)
        server = servers[name] = Server(name, managed.base_url)
        stack.callback(server.client.close)
        server.model = server.client.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        server.chat(WARMUP, 48)  # first requests (and first drafts) pay one-off costs
    return servers


def rotated(names: list[str], k: int) -> list[str]:
    return names[k % len(names) :] + names[: k % len(names)]


def ratios(rates: dict[str, float], base: str = "none") -> dict[str, float]:
    """Each setting's decode tokens/s over ``base``'s."""
    if not rates.get(base):
        return {}
    return {f"{n}_vs_{base}": round(r / rates[base], 3) for n, r in rates.items() if n != base}


def add_systems_arg(parser: argparse.ArgumentParser) -> None:
    choices = ", ".join(SYSTEMS)
    parser.add_argument("--systems", default="defaults,none,all",
                        help=f"comma-separated draft settings from: {choices}")  # fmt: skip
