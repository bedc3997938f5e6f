"""KV-transfer throughput with keys against plain ZeroMQ, on loopback.

Method: a spawned prefill peer holds a KV pool with the layout of a real model (the default
SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 unless ``--dtype``) and a ``ZmqKVSender``
per kind; the decode side (this process) has a ``ZmqKVReceiver`` of each kind:

- ``plain``: plain ZeroMQ (``--zmq-unauthenticated``);
- ``sealed``: CurveZMQ keys, as served: the KV under AES-256-GCM on the sealed data
  connection, everything else on CurveZMQ (``disagg/zmq_sealed.py``);
- ``curve``: CurveZMQ keys with the KV over CurveZMQ itself (``sealed_data=False``).

One transfer moves a prompt of ``--tokens`` tokens (4096) from
the peer's pool into ours: the decode side asks, the peer pushes it in one call (gather,
the wire, scatter in the decode engine's thread, as in serving), and the time runs from the
request to the DONE status. The kinds alternate (plain, sealed, curve, plain, ...) for
``--rounds`` rounds after one warm-up transfer each, so drift on a shared machine hits all
alike; the figure is the median over rounds of each kind, and the ratios of the medians. The
CPU seconds both processes spent per transfer (their own accounting, ``/proc``, all threads:
ZeroMQ's I/O threads encrypt and decrypt) are the figure that a busy machine moves least.
Every transfer is checked byte for byte against the peer's pool.

Usage: ``python -m benchmarks.fleet.bench_transfer_keys [--tokens 4096] [--rounds 7]
[--dtype float32|bfloat16] [--message-bytes N] [--kinds plain,sealed,curve]``; prints one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import select
import statistics
import time

import torch

from radixserve.cache.kv_pool import KVPool, KVShape
from radixserve.disagg import KVLayout, TransferState
from radixserve.links.keys import PLAIN, CurveKeys
from radixserve.utils import cpu_model

SHAPE = dict(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M-Instruct
KINDS = ("plain", "sealed", "curve")


def pool_of(num_slots: int, dtype: str, seed: int | None) -> KVPool:
    shape = KVShape(SHAPE["layers"], SHAPE["kv_heads"], SHAPE["head_dim"], getattr(torch, dtype))
    pool = KVPool(shape, num_slots)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        pool.k.copy_(torch.randn(pool.k.shape, generator=g).to(pool.k.dtype))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g).to(pool.v.dtype))
    return pool


def layout(pool: KVPool) -> KVLayout:
    return KVLayout.of_pool(pool, "bench", 1)


def peer(reports, tokens: int, dtype: str, keys: CurveKeys, message_bytes: int | None) -> None:
    """The prefill side: push every requested transfer whole, from slots 0..tokens-1."""
    from radixserve.disagg.zmq_sender import ZmqKVSender

    pool = pool_of(tokens, dtype, seed=7)
    size = {} if message_bytes is None else {"message_bytes": message_bytes}
    senders = {kind: ZmqKVSender(pool, layout(pool), security=PLAIN if kind == "plain" else keys,
                                 **size) for kind in KINDS}  # fmt: skip
    reports.put({name: s.endpoint for name, s in senders.items()})
    src = torch.arange(tokens)
    while True:
        select.select([s.fileno() for s in senders.values()], [], [], 0.05)
        for sender in senders.values():
            for req in sender.incoming():
                sender.push(req.transfer_id, src[: req.num_tokens])
            sender.finished()


def landed_whole(got: KVPool, want: KVPool, n: int) -> bool:
    """Slots 0..n-1 equal in both pools (the extra padding slot is never sent)."""
    return all(torch.equal(a[:, :, :n], b[:, :, :n]) for a, b in ((got.k, want.k), (got.v, want.v)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (``/proc/PID/stat``)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_transfer(receiver, endpoint: str, tokens: int) -> float:
    t0 = time.perf_counter()
    tid = receiver.request(endpoint, torch.arange(tokens), {}, b"", 120.0)
    while True:
        for key, status in receiver.progress():
            if key == tid:
                if status.state is not TransferState.DONE:
                    raise RuntimeError(f"transfer failed: {status.reason}")
                return time.perf_counter() - t0
        select.select([receiver.fileno()], [], [], 0.01)


def main() -> None:
    from radixserve.disagg.zmq_receiver import ZmqKVReceiver

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--message-bytes", type=int, default=None,
                   help="the senders' DATA message size (default: the sender's own)")  # fmt: skip
    p.add_argument("--kinds", default=",".join(KINDS), help="which kinds to alternate")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    if "plain" not in kinds or not set(kinds) <= set(KINDS):
        p.error(f"--kinds: plain and any of {KINDS[1:]}")
    keys = CurveKeys.generate()
    reports = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(
        target=peer, args=(reports, args.tokens, args.dtype, keys, args.message_bytes), daemon=True
    )
    proc.start()
    try:
        endpoints = reports.get(timeout=120)
        pools = {m: pool_of(args.tokens, args.dtype, None) for m in kinds}
        receivers = {
            m: ZmqKVReceiver(pools[m], layout(pools[m]), security=PLAIN if m == "plain" else keys,
                             sealed_data=m == "sealed")
            for m in kinds
        }  # fmt: skip
        source = pool_of(args.tokens, args.dtype, seed=7)
        times: dict[str, list[float]] = {m: [] for m in kinds}
        cpu: dict[str, list[float]] = {m: [] for m in kinds}
        for r in range(args.rounds + 1):
            for mode in kinds:
                pools[mode].k.zero_()
                pools[mode].v.zero_()
                cpu0 = cpu_seconds(os.getpid()) + cpu_seconds(proc.pid)
                took = one_transfer(receivers[mode], endpoints[mode], args.tokens)
                spent = cpu_seconds(os.getpid()) + cpu_seconds(proc.pid) - cpu0
                if not landed_whole(pools[mode], source, args.tokens):
                    raise RuntimeError(f"{mode}: the KV that landed differs from the source")
                if r:  # round 0 warms both up (connections, handshakes, page faults)
                    times[mode].append(took)
                    cpu[mode].append(spent)
        for rx in receivers.values():
            rx.close()
    finally:
        proc.kill()
        proc.join(10)
    nbytes = args.tokens * layout(source).bytes_per_token()
    med = {m: statistics.median(ts) for m, ts in times.items()}
    out = {
        "tokens": args.tokens,
        "dtype": args.dtype,
        "message_bytes": args.message_bytes,
        "mb_per_transfer": round(nbytes / 1e6, 1),
        **{f"{m}_s": round(med[m], 4) for m in med},
        **{f"{m}_mb_per_s": round(nbytes / med[m] / 1e6, 1) for m in med},
        **{
            f"{m}_over_plain_throughput": round(med["plain"] / med[m], 3)
            for m in kinds
            if m != "plain"
        },
        **{f"{m}_cpu_s": round(statistics.median(c), 3) for m, c in cpu.items()},
        "rounds": args.rounds,
        "all_s": {m: [round(t, 4) for t in ts] for m, ts in times.items()},
        "cpu": cpu_model(),
        "machine": platform.machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
