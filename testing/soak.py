"""A randomized soak of a running server: multi-turn chats, aborts, flushes, preemption.

Workers run random sessions against one server until the time is up: multi-turn chats
(streamed or not, each turn carrying the history, under two tenants' keys and random cache
salts), streams dropped mid-way, non-streaming requests whose client times out, and cache
flushes with the admin key. A KV pool smaller than the load forces preemption. Every HTTP
answer must be 200, a 4xx we caused on purpose, or a client-side abort: any 5xx is counted
and fails the soak. At the end the server must be idle with no slot held by a request
(``kv_cache_used_tokens == radix_cache_cached_tokens``) and its integrity check must pass.

``python -m testing.soak --minutes 30`` starts a server on the default model itself and prints
one JSON line per sample with the RSS of both processes (the HTTP server and the engine),
then the report.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from testing.server import engine_pid, rss_bytes, started_server, wait_idle

WORDS = "radix tree cache prefix token slot page engine request batch stream model".split()


@dataclass
class SoakReport:
    outcomes: dict[str, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, what: str) -> None:
        with self.lock:
            self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def check(self, r: httpx.Response, what: str) -> None:
        if r.status_code >= 500:
            with self.lock:
                self.server_errors.append(f"{what}: {r.status_code} {r.text[:200]}")
        self.count(f"{what}:{r.status_code}")

    def summary(self) -> dict:
        return {
            "outcomes": dict(sorted(self.outcomes.items())),
            "server_errors": self.server_errors,
        }


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Worker:
    def __init__(self, url: str, keys: list[str], admin: str, report: SoakReport, seed: int):
        self.url, self.keys, self.admin, self.report = url, keys, admin, report
        self.rng = random.Random(seed)
        self.http = httpx.Client(timeout=120)
        self.until = 0.0

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def chat(self) -> None:
        key = self.rng.choice(self.keys)
        salt = self.rng.choice([None, None, "s1", "s2"])
        history = [{"role": "system", "content": _sentence(self.rng, 30)}]
        for _ in range(self.rng.randint(2, 4)):
            if time.monotonic() > self.until:
                return
            history.append(
                {"role": "user", "content": _sentence(self.rng, self.rng.randint(5, 40))}
            )
            body = {
                "messages": history,
                "max_tokens": self.rng.randint(4, 48),
                "temperature": self.rng.choice([0, 0.7, 1.0]),
                "ignore_eos": self.rng.random() < 0.5,
                **({"cache_salt": salt} if salt else {}),
            }
            if self.rng.random() < 0.5:
                text = self._stream(body, key)
                if text is None:
                    return
            else:
                r = self.http.post(
                    self.url + "/v1/chat/completions", json=body, headers=self.headers(key)
                )
                self.report.check(r, "chat")
                if r.status_code != 200:
                    return
                text = r.json()["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": text})

    def _stream(self, body: dict, key: str) -> str | None:
        parts = []
        with self.http.stream(
            "POST", self.url + "/v1/chat/completions", json={**body, "stream": True},
            headers=self.headers(key),
        ) as r:  # fmt: skip
            self.report.check(r, "stream")
            if r.status_code != 200:
                return None
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.report.server_errors.append(f"stream error event: {chunk}")
                    return None
                parts.extend(c["delta"].get("content") or "" for c in chunk["choices"])
        return "".join(parts)

    def drop_stream(self) -> None:
        body = {
            "prompt": _sentence(self.rng, 50),
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with self.http.stream(
            "POST", self.url + "/v1/completions", json=body, headers=self.headers(self.keys[0])
        ) as r:
            self.report.check(r, "drop_stream")
            for i, _ in enumerate(r.iter_lines()):
                if i >= self.rng.randint(2, 20):
                    break  # hang up mid-stream
        self.report.count("dropped_stream")

    def time_out(self) -> None:
        body = {"prompt": _sentence(self.rng, 40), "max_tokens": 600, "ignore_eos": True}
        try:
            r = httpx.post(
                self.url + "/v1/completions", json=body, headers=self.headers(self.keys[-1]),
                timeout=self.rng.uniform(0.2, 1.5),
            )  # fmt: skip
            self.report.check(r, "time_out")
        except httpx.TimeoutException:
            self.report.count("client_timed_out")

    def flush(self) -> None:
        r = self.http.post(self.url + "/flush_cache", headers=self.headers(self.admin))
        self.report.check(r, "flush")

    def run(self, until: float) -> None:
        self.until = until
        actions = [(self.chat, 6), (self.drop_stream, 2), (self.time_out, 2), (self.flush, 1)]
        while time.monotonic() < until:
            action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            try:
                action()
            except httpx.TransportError as e:  # a dropped connection is a server failure
                with self.report.lock:
                    self.report.server_errors.append(f"{action.__name__}: {e!r}")
        self.http.close()


def run_soak(
    url: str, keys: list[str], admin: str, seconds: float, workers: int = 6, seed: int = 0
) -> SoakReport:
    """Run the soak for ``seconds``; the caller checks the report and the server after."""
    report = SoakReport()
    until = time.monotonic() + seconds
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [
            pool.submit(Worker(url, keys, admin, report, seed * 1000 + i).run, until)
            for i in range(workers)
        ]
        for f in futures:
            f.result()
    return report


def check_server_after(url: str, keys: list[str], admin: str) -> dict[str, float]:
    """Idle, no slot held by a request, integrity ok; returns the final metrics."""
    m = wait_idle(url, {"Authorization": f"Bearer {keys[0]}"}, timeout=60)
    assert m["kv_cache_used_tokens"] == m["radix_cache_cached_tokens"], m  # nothing held
    r = httpx.get(url + "/debug/check_integrity", headers={"Authorization": f"Bearer {admin}"})
    assert r.status_code == 200, r.text
    assert httpx.get(url + "/health").status_code == 200
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--sample-seconds", type=float, default=30)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("server_args", nargs="*", help="extra `radixserve serve` flags")
    args = p.parse_args()
    keys, admin = ["soak-a", "soak-b"], "soak-admin"
    flags = ["--api-key", keys[0], "--api-key", keys[1], "--admin-key", admin,
             "--max-total-tokens", "2048", *args.server_args]  # fmt: skip
    with started_server(*flags) as server:
        pids = {"server": server.proc.pid, "engine": engine_pid(server.proc.pid)}
        start = time.monotonic()
        done = threading.Event()

        def sample() -> None:
            while not done.wait(args.sample_seconds):
                row = {"t_s": round(time.monotonic() - start)}
                row.update(
                    {f"{k}_rss_mib": round(rss_bytes(v) / 2**20, 1) for k, v in pids.items()}
                )
                print(json.dumps(row), flush=True)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        report = run_soak(server.url, keys, admin, args.minutes * 60, args.workers)
        done.set()
        final = check_server_after(server.url, keys, admin)
        print(json.dumps({
            **report.summary(),
            "engine_pid_unchanged": engine_pid(server.proc.pid) == pids["engine"],
            "retracted_requests": final["radix_retracted_requests_total"],
            "kv_used_tokens": final["kv_cache_used_tokens"],
            "cached_tokens": final["radix_cache_cached_tokens"],
            "integrity": "ok",
        }), flush=True)  # fmt: skip
    return 1 if report.server_errors else 0


if __name__ == "__main__":
    sys.exit(main())
