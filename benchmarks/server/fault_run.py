"""A fault run through the router: real processes, real signals, 8 concurrent chat clients.

Setup (all on free loopback ports): a valkey server as the shared ``--kv-storage`` tier, two
``radixserve serve`` workers (default model, a small device pool, a host tier, the storage
tier, ``--admin-key``) and a router in front (``--api-key``, ``--admin-key``,
``--worker-api-key``, ``--first-byte-timeout`` 10 s). Each worker is a plain ``serve``
process; the script plays the operator's supervisor and restarts a killed worker on its port.
The workers publish KV events to the router, and every ZeroMQ link (events, their replay, KV
transfers) runs CurveZMQ with a fleet key pair drawn for the run (``$RADIXSERVE_ZMQ_KEY``), as
by default; afterwards no instance may have turned a connection away.

Phases, each with 8 clients running 3-turn chats (greedy, streamed or not) while it injects:

- ``kill9``: SIGKILL of worker 0 (server and engine), restarted after 5 s;
- ``sigstop``: SIGSTOP of worker 1 (server and engine) for 60 s, then SIGCONT;
- ``valkey_kill``: the storage server killed, restarted on its port after 5 s;
- ``valkey_stop``: the storage server stopped for 15 s, then continued;
- ``pd_kill``: a second router with ``--prefill``/``--decode`` in front of a prefill and a
  decode instance (every prompt's KV moved); the prefill instance killed with SIGKILL while
  transfers run.

Each request is ``ok`` (a complete answer with a ``finish_reason``; a stream ends with
``[DONE]``), ``error`` (a 4xx/5xx in the OpenAI envelope, or an SSE error event) or ``bad``
(a stream cut without an error event, no answer within the limit, a dropped connection, a
malformed answer). Afterwards every live instance must pass ``/debug/check_integrity``, run
nothing and hold no slot (``kv_cache_used_tokens == radix_cache_cached_tokens``).

Prints one JSON line. Usage: ``python -m benchmarks.server.fault_run [--stop-seconds 60]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from collections import Counter

import httpx

from radixserve.bench.processes import Proc, read_metrics
from radixserve.links.keys import CurveKeys
from testing.redis_server import RedisServer, free_port

TENANT, ADMIN, WORKER_KEY = "fault-tenant", "fault-admin", "fault-worker-admin"
FIRST_BYTE_TIMEOUT = 10.0
WORDS = "radix tree cache prefix token slot page engine request batch stream model".split()


EVENTS = ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint",
          "tcp://127.0.0.1:0"]  # fmt: skip


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (a server and its engine process)."""
    out = [pid]
    try:
        for c in open(f"/proc/{pid}/task/{pid}/children").read().split():
            out += tree_pids(int(c))
    except OSError:
        pass
    return out


def signal_tree(proc: Proc, sig: int) -> None:
    for pid in tree_pids(proc.proc.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def worker_args(port: int, *extra: str) -> list[str]:
    return ["serve", "--port", str(port), "--log-level", "warning", "--dtype", "float32",
            "--max-total-tokens", "2048", "--admin-key", WORKER_KEY, *extra]  # fmt: skip


def start_worker(port: int, *extra: str) -> Proc:
    return Proc(worker_args(port, *extra), "radixserve listening on")


def start_router(*args: str) -> Proc:
    return Proc(
        ["router", "--port", "0", "--log-level", "warning", "--api-key", TENANT,
         "--admin-key", ADMIN, "--worker-api-key", WORKER_KEY,
         "--first-byte-timeout", str(FIRST_BYTE_TIMEOUT), *args],
        "radixserve router listening on",
    )  # fmt: skip


class Clients:
    """Chat clients classifying every answer; ``limit`` is the longest a request may take."""

    def __init__(self, url: str, limit: float, system_words: int):
        self.url, self.limit, self.system_words = url, limit, system_words
        self.counts: Counter[str] = Counter()
        self.bad: list[str] = []
        self.errors: Counter[str] = Counter()  # "status: message" of the clean errors
        self.max_s = 0.0
        self.lock = threading.Lock()

    def record(self, outcome: str, took: float, detail: str = "") -> str:
        with self.lock:
            self.counts[outcome] += 1
            self.max_s = max(self.max_s, took)
            if outcome == "bad":
                self.bad.append(detail[:300])
            elif outcome == "error":
                self.errors[detail[:90]] += 1
        return outcome

    def ask(self, http: httpx.Client, body: dict) -> tuple[str, str]:
        t0 = time.monotonic()
        try:
            text, outcome, detail = self._send(http, body, t0)
        except httpx.TimeoutException as e:
            text, outcome, detail = "", "bad", f"hang: {e!r}"
        except (httpx.TransportError, ValueError, KeyError, IndexError, TypeError) as e:
            text, outcome, detail = "", "bad", f"broken: {e!r}"
        return self.record(outcome, time.monotonic() - t0, detail), text

    def _send(self, http: httpx.Client, body: dict, t0: float) -> tuple[str, str, str]:
        headers = {"Authorization": f"Bearer {TENANT}"}
        url = self.url + "/v1/chat/completions"
        if not body.get("stream"):
            r = http.post(url, json=body, headers=headers)
            if r.status_code != 200:
                return "", *envelope(r.status_code, r.text)
            choice = r.json()["choices"][0]
            if choice["finish_reason"] not in ("stop", "length"):
                return "", "bad", f"finish_reason {choice['finish_reason']!r}"
            return choice["message"]["content"], "ok", ""
        with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return "", *envelope(r.status_code, r.read().decode(errors="replace"))
            parts, finish, done = [], None, False
            for line in r.iter_lines():
                if time.monotonic() - t0 > self.limit:
                    return "", "bad", "hang: stream past the limit"
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "", "error", f"sse: {chunk['error'].get('message')}"
                    for c in chunk["choices"]:
                        parts.append(c["delta"].get("content") or "")
                        finish = c.get("finish_reason") or finish
            if not done or finish is None:
                return "", "bad", f"stream cut: done={done} finish={finish}"
            return "".join(parts), "ok", ""

    def chat(self, seed: int, until: float) -> None:
        timeout = httpx.Timeout(self.limit, connect=10)
        with httpx.Client(timeout=timeout) as http:
            n = 0
            while time.monotonic() < until:
                n += 1
                words = [WORDS[(seed * 7 + n * 3 + i) % len(WORDS)] for i in range(40)]
                system = f"client {seed} chat {n}: " + " ".join(words * (self.system_words // 40))
                history = [{"role": "system", "content": system}]
                for turn in range(3):
                    if time.monotonic() >= until:
                        return
                    history.append(
                        {"role": "user", "content": f"turn {turn}: {' '.join(words[:9])}"}
                    )
                    body = {"messages": history, "max_tokens": 16, "temperature": 0,
                            "stream": (seed + turn) % 2 == 0}  # fmt: skip
                    outcome, text = self.ask(http, body)
                    if outcome != "ok":
                        break
                    history.append({"role": "assistant", "content": text})


def run_phase(clients: Clients, seconds: float, inject, n: int = 8) -> dict:
    """8 clients for ``seconds`` while ``inject()`` runs; their counts and longest request."""
    until = time.monotonic() + seconds
    with concurrent.futures.ThreadPoolExecutor(n + 1) as pool:
        futures = [pool.submit(clients.chat, i, until) for i in range(n)]
        injected = pool.submit(inject)
        for f in [*futures, injected]:
            f.result()
    result = {**clients.counts, "max_request_s": round(clients.max_s, 1),
              "bad_detail": clients.bad, "errors": dict(clients.errors.most_common(4))}  # fmt: skip
    print(json.dumps(result), file=sys.stderr, flush=True)  # progress, phase by phase
    return result


def envelope(status: int, text: str) -> tuple[str, str]:
    try:
        error = json.loads(text)["error"]
        if status >= 400 and isinstance(error.get("message"), str):
            return "error", f"{status}: {error['message']}"
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return "bad", f"{status} not an OpenAI error: {text[:200]}"


def after(seconds: float, fn) -> None:
    time.sleep(seconds)
    fn()


def healthy(router_url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(router_url + "/health", timeout=5).json().get("status") == "ok":
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    return False


def settled(url: str, timeout: float = 90) -> dict:
    """Idle, nothing held and the integrity check passed, or what was found instead."""
    headers = {"Authorization": f"Bearer {WORKER_KEY}"}
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url, headers)
        idle = m["num_running_reqs"] == 0 and m["num_queue_reqs"] == 0
        held = m["kv_cache_used_tokens"] - m["radix_cache_cached_tokens"]
        if (idle and held == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    check = httpx.get(url + "/debug/check_integrity", headers=headers, timeout=60)
    integrity = "ok" if check.status_code == 200 else check.text[:200]
    running = m["num_running_reqs"] + m["num_queue_reqs"]
    return {"integrity": integrity, "running": running, "held_tokens": held,
            "zmq_refused": refused_connections(url, headers)}  # fmt: skip


def refused_connections(url: str, headers: dict[str, str]) -> int:
    """All connections the instance's ZeroMQ sockets turned away (a key that did not fit)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("zmq_refused_connections_total{")))  # fmt: skip


def fleet_phases(args, out: dict) -> None:
    with RedisServer() as valkey:
        tiers = ["--host-kv-memory", "256MiB", "--kv-storage", valkey.url, *EVENTS]
        ports = [free_port(), free_port()]
        workers = [start_worker(p, *tiers) for p in ports]
        router = None
        try:
            for w in workers:
                w.wait()
            router = start_router(*(a for w in workers for a in ("--worker", w.url))).wait()
            limit = FIRST_BYTE_TIMEOUT + args.margin
            phase = lambda s, f: run_phase(Clients(router.url, limit, 40), s, f)  # noqa: E731

            def kill_restart() -> None:
                time.sleep(3)
                signal_tree(workers[0], signal.SIGKILL)
                workers[0].proc.wait()
                time.sleep(5)
                workers[0] = start_worker(ports[0], *tiers).wait()

            out["kill9"] = phase(args.phase_seconds, kill_restart)
            out["kill9"]["fleet_ok_again"] = healthy(router.url, 180)

            def stop_cont() -> None:
                time.sleep(3)
                signal_tree(workers[1], signal.SIGSTOP)
                time.sleep(args.stop_seconds)
                signal_tree(workers[1], signal.SIGCONT)

            out["sigstop"] = phase(args.stop_seconds + 10, stop_cont)
            out["sigstop"]["fleet_ok_again"] = healthy(router.url, 120)

            def valkey_kill() -> None:
                time.sleep(3)
                valkey.kill()
                time.sleep(5)
                valkey.start()

            out["valkey_kill"] = phase(args.phase_seconds, valkey_kill)
            pause = lambda: (time.sleep(3), valkey.proc.send_signal(signal.SIGSTOP),  # noqa: E731
                             time.sleep(15), valkey.proc.send_signal(signal.SIGCONT))  # fmt: skip
            out["valkey_stop"] = phase(args.phase_seconds, pause)
            out["fleet_after"] = [settled(w.url) for w in workers]
        finally:
            for p in [router, *workers]:
                if p is not None:
                    p.stop()


def pd_phase(args, out: dict) -> None:
    prefill = Proc(worker_args(0, "--disaggregation-mode", "prefill", *EVENTS),
                   "radixserve listening on")  # fmt: skip
    decode = Proc(worker_args(0, "--disaggregation-mode", "decode", "--remote-prefill-min-tokens",
                              "1", *EVENTS), "radixserve listening on")  # fmt: skip
    router = None
    try:
        prefill.wait(), decode.wait()
        router = start_router("--prefill", prefill.url, "--decode", decode.url,
                              "--local-prefill-tokens", "1").wait()  # fmt: skip
        info = {}

        def kill_prefill() -> None:
            time.sleep(5)
            headers = {"Authorization": f"Bearer {WORKER_KEY}"}
            r = httpx.get(decode.url + "/disagg/info", headers=headers)
            info["before_kill"] = r.json()["stats"]["transfers_done"]
            signal_tree(prefill, signal.SIGKILL)

        limit = FIRST_BYTE_TIMEOUT + args.margin
        out["pd_kill"] = run_phase(
            Clients(router.url, limit, 120), args.phase_seconds, kill_prefill
        )
        out["pd_kill"]["transfers_before_kill"] = info.get("before_kill")
        out["pd_after"] = [settled(decode.url)]
    finally:
        for p in (router, decode, prefill):
            if p is not None:
                p.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase-seconds", type=float, default=30, help="clients' time per phase")
    p.add_argument("--stop-seconds", type=float, default=60, help="SIGSTOP length of a worker")
    p.add_argument(
        "--margin",
        type=float,
        default=50,
        help="seconds past --first-byte-timeout before a request counts as hung",
    )
    args = p.parse_args()
    # the fleet's key pair, inherited by every process this run starts
    os.environ["RADIXSERVE_ZMQ_KEY"] = CurveKeys.generate().secret_key.decode()
    out: dict = {"first_byte_timeout_s": FIRST_BYTE_TIMEOUT, "zmq_links": "CurveZMQ",
                 "request_limit_s": FIRST_BYTE_TIMEOUT + args.margin}  # fmt: skip
    t0 = time.monotonic()
    fleet_phases(args, out)
    pd_phase(args, out)
    out["total_s"] = round(time.monotonic() - t0)
    print(json.dumps(out), flush=True)
    bad = sum(v.get("bad", 0) for v in out.values() if isinstance(v, dict))
    clean = all(c["integrity"] == "ok" and not c["running"] and not c["held_tokens"]
                and not c["zmq_refused"] for c in out["fleet_after"] + out["pd_after"])  # fmt: skip
    return 0 if bad == 0 and clean else 1


if __name__ == "__main__":
    sys.exit(main())
