"""The router's cost per request with its links protected (HTTPS and CurveZMQ) and plain.

Method: two fleets of one real worker (``serve``, the default model unless ``--model``, KV
events on) behind a real ``router`` (cache-aware, subscribed to the worker's events) run side
by side on loopback:

- ``plain``: HTTP everywhere, ``--zmq-unauthenticated`` on both ends of the events link;
- ``secure``: the worker and the router serve HTTPS (certificates from a throwaway CA,
  ``trustme``), the router checks the worker's certificate (``--worker-ca-certs``), and the
  events and their replay run CurveZMQ with a key pair drawn for the run (``--zmq-key``).

One client per fleet keeps its connections open (as a client library does); the router keeps
its own to the worker. A round sends the same short completion (``--max-tokens`` 1, a prompt
the worker has cached after the warm-up) four times: to the plain worker, through the plain
router, to the secure worker, through the secure router, the order of the two fleets
alternating per round, so drift on a shared machine hits all four alike. The router's
overhead is the time through the router less the time straight to the worker, paired within
a round; the figure is the median over ``--rounds`` rounds of each fleet, and the
difference of those medians (secure - plain) is what protecting the links costs per request.

Usage: ``python -m benchmarks.fleet.bench_router_links [--rounds 200] [--model DIR]``;
prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from radixserve.bench.processes import Proc
from radixserve.links.keys import CurveKeys, write_key_files
from radixserve.utils import cpu_model

PROMPT = "Write one word about the sea:"
EVENTS = ["--kv-events-endpoint", "tcp://127.0.0.1:0",
          "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]  # fmt: skip


def make_pki(d: Path) -> dict[str, str]:
    """A throwaway CA and the certificate both servers present (127.0.0.1)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(d / "ca.pem")
    cert.private_key_pem.write_to_path(d / "server.key")
    cert.cert_chain_pems[0].write_to_path(d / "server.pem")
    return {"ca": str(d / "ca.pem"), "key": str(d / "server.key"), "cert": str(d / "server.pem")}


def fleet_flags(d: Path) -> dict[str, tuple[list[str], list[str], str | bool]]:
    """Per fleet: the worker's extra flags, the router's, and how a client checks servers."""
    pki = make_pki(d)
    keyfile = str(write_key_files(CurveKeys.generate(), d / "fleet")[1])
    tls = ["--ssl-keyfile", pki["key"], "--ssl-certfile", pki["cert"]]
    return {
        "plain": (["--zmq-unauthenticated"], ["--zmq-unauthenticated"], True),
        "secure": (
            ["--zmq-key", keyfile, *tls],
            ["--zmq-key", keyfile, "--worker-ca-certs", pki["ca"], *tls],
            pki["ca"],
        ),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (``/proc/PID/stat``)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_fleets(model: list[str], d: Path) -> tuple[dict, list[Proc]]:
    flags = fleet_flags(d)
    procs: list[Proc] = []
    workers = {}
    for name, (worker_flags, _, _) in flags.items():
        procs.append(Proc(["serve", *model, "--port", "0", "--log-level", "warning",
                           "--max-total-tokens", "4096", *EVENTS, *worker_flags],
                          "radixserve listening on"))  # fmt: skip
        workers[name] = procs[-1]
    for p in workers.values():
        p.wait(600)
    urls = {}
    for name, (_, router_flags, verify) in flags.items():
        router = Proc(["router", *model, "--port", "0", "--log-level", "warning",
                       "--worker", workers[name].url, *router_flags],
                      "radixserve router listening on").wait(600)  # fmt: skip
        procs.append(router)
        urls[name] = (workers[name].url, router.url, verify, router.proc.pid)
    return urls, procs


def timed(client: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body, timeout=120)
    took = time.perf_counter() - t0
    if r.status_code != 200 or not r.json()["choices"]:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
    return took


def subscribed(client: httpx.Client, router: str) -> bool:
    workers = client.get(router + "/workers", timeout=10).json()["workers"]
    return all(w.get("kv_events") for w in workers)


def measure(urls: dict, rounds: int, max_tokens: int) -> dict[str, dict[str, list[float]]]:
    clients = {name: httpx.Client(verify=u[2]) for name, u in urls.items()}
    worker, client = urls["plain"][0], clients["plain"]
    served = client.get(worker + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": served, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    for name, (_, router, *_) in urls.items():
        if not subscribed(clients[name], router):
            raise RuntimeError(f"{name}: the router has no KV events from its worker")
    times = {name: {"direct": [], "router": [], "router_cpu": []} for name in urls}
    order = list(urls)
    for r in range(rounds + 5):  # 5 warm-up rounds: connections, the prompt cached
        for name in order if r % 2 else order[::-1]:
            worker, router, _, pid = urls[name]
            direct = timed(clients[name], worker, body)
            cpu0 = cpu_seconds(pid)
            routed = timed(clients[name], router, body)
            if r >= 5:
                times[name]["direct"].append(direct)
                times[name]["router"].append(routed)
                times[name]["router_cpu"].append(cpu_seconds(pid) - cpu0)
    for c in clients.values():
        c.close()
    return times


def summary(times: dict[str, dict[str, list[float]]]) -> dict:
    out = {}
    for name, t in times.items():
        overhead = [b - a for a, b in zip(t["direct"], t["router"], strict=True)]
        out[f"{name}_direct_ms_p50"] = round(1e3 * statistics.median(t["direct"]), 3)
        out[f"{name}_router_ms_p50"] = round(1e3 * statistics.median(t["router"]), 3)
        out[f"{name}_overhead_ms_p50"] = round(1e3 * statistics.median(overhead), 3)
        q = statistics.quantiles(overhead, n=4)
        out[f"{name}_overhead_ms_iqr"] = [round(1e3 * q[0], 3), round(1e3 * q[2], 3)]
        out[f"{name}_router_cpu_ms_per_request"] = round(1e3 * statistics.mean(t["router_cpu"]), 3)
    for figure in ("overhead_ms_p50", "router_cpu_ms_per_request"):
        out[f"secure_minus_plain_{figure}"] = round(
            out[f"secure_{figure}"] - out[f"plain_{figure}"], 3
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--model", default=None, help="a model directory or name (default: serve's)")
    args = p.parse_args()
    model = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory() as d:
        urls, procs = start_fleets(model, Path(d))
        try:
            times = measure(urls, args.rounds, args.max_tokens)
        finally:
            for proc in procs:
                proc.stop()
    out = {
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        **summary(times),
        "cpu": cpu_model(),
        "machine": platform.machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
