"""A prefill (or decode) peer for KV transfer tests, run in its own spawned process.

The prefill peer holds a KV pool filled from a seed (``seeded_pool``, so the test process can
rebuild the same content), serves transfers with ``ZmqKVSender`` and does what each request's
``meta`` says: ``src`` (slots to send), ``mode`` (normal, silent, abort, die_after,
late), ``pieces``. It reports through a queue: its endpoints first, then every transfer that
ended, as ``(transfer_id, state value, reason)``. Spawning it costs a torch import, so one
process serves every layout the tests need.
"""

from __future__ import annotations

import os
import select
import time

import torch

from radixserve.cache.kv_format import KVFormat
from radixserve.cache.kv_pool import KVPool, KVShape
from radixserve.disagg.transfer import KVLayout
from radixserve.links.keys import CurveKeys, load_security

HEARTBEAT = dict(heartbeat_interval=0.1, heartbeat_timeout=0.8)


def seeded_pool(num_slots: int, dtype: str, seed: int | None, layers: int = 3) -> KVPool:
    """A pool of float KV of ``dtype`` (head size 8), or of int8 rows (``"int8"``: head size
    16, every byte of a row random, scales included)."""
    if dtype == "int8":
        shape = KVShape(layers, 2, 16, torch.float32, kv_format=KVFormat.of("int8"))
    else:
        shape = KVShape(layers, 2, 8, getattr(torch, dtype))
    pool = KVPool(shape, num_slots)
    if seed is None:
        pool.k.zero_()
        pool.v.zero_()
    else:
        g = torch.Generator().manual_seed(seed)
        for t in (pool.k, pool.v):
            if dtype == "int8":
                t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
            else:
                t.copy_(torch.randn(t.shape, generator=g))
    return pool


def layout_of(pool: KVPool, page_size: int = 1) -> KVLayout:
    return KVLayout.of_pool(pool, "test-model", page_size)


def poll_until(fn, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := fn():
            return out
        time.sleep(0.01)
    raise AssertionError(f"{fn.__name__} returned nothing in {timeout} s")


def wait_end(receiver, tid: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for key, status in receiver.progress():
            if key == tid:
                return status
        time.sleep(0.01)
    raise AssertionError(f"transfer {tid} did not end in {timeout} s")


def untouched(pool, except_slots: torch.Tensor | None = None) -> bool:
    mask = torch.ones(pool.k.shape[2], dtype=torch.bool)
    if except_slots is not None:
        mask[except_slots] = False
    return not pool.k[:, :, mask].any() and not pool.v[:, :, mask].any()


# The two senders one peer process runs: (dtype, page size, target message bytes). The
# float32 one uses tiny messages, so a transfer goes out as several token pieces and layer
# groups.
PEER_LAYOUTS = {
    "f32": ("float32", 1, 200),
    "bf16": ("bfloat16", 4, 1 << 20),
    "i8": ("int8", 4, 300),
}


def run_prefill_peer(reports, seed: int) -> None:
    from radixserve.disagg.zmq_sender import ZmqKVSender

    senders = {}
    for name, (dtype, page_size, message_bytes) in PEER_LAYOUTS.items():
        pool = seeded_pool(256, dtype, seed)
        layout = layout_of(pool, page_size)
        senders[name] = ZmqKVSender(
            pool, layout, security=load_security(), message_bytes=message_bytes, **HEARTBEAT
        )
    reports.put({name: s.endpoint for name, s in senders.items()})
    late: list[tuple[float, str, torch.Tensor, ZmqKVSender]] = []
    while True:
        select.select([s.fileno() for s in senders.values()], [], [], 0.05)
        for sender in senders.values():
            for req in sender.incoming():
                src = torch.tensor(req.meta["src"])
                mode = req.meta.get("mode", "normal")
                if mode == "normal":
                    for piece in torch.tensor_split(src, req.meta.get("pieces", 1)):
                        sender.push(req.transfer_id, piece)
                elif mode == "abort":
                    sender.abort(req.transfer_id, "prompt rejected by the test")
                elif mode == "die_after":
                    sender.push(req.transfer_id, src[: req.meta["n"]])
                    time.sleep(0.2)  # let ZeroMQ put the first tokens on the wire
                    os._exit(3)
                elif mode == "late":
                    when = time.monotonic() + req.meta["delay"]
                    late.append((when, req.transfer_id, src, sender))
            for tid, status in sender.finished():
                reports.put((tid, status.state.value, status.reason))
        for item in list(late):
            when, tid, src, sender = item
            if time.monotonic() >= when:
                late.remove(item)
                try:
                    sender.push(tid, src)
                except Exception as e:  # ended meanwhile (cancelled): report, go on
                    reports.put((tid, "push_refused", str(e)))


def garbage_pool(layout: KVLayout, num_slots: int = 4096) -> KVPool:
    """A pool of ``layout`` full of large random KV: a model that reads it answers wrong."""
    fmt = layout.format
    dtype = torch.float32 if fmt.quantized else fmt.storage_dtype  # the values' dtype
    shape = KVShape(layout.num_layers, layout.num_kv_heads, layout.head_dim, dtype,
                    kv_format=fmt)  # fmt: skip
    pool = KVPool(shape, num_slots)
    g = torch.Generator().manual_seed(0)
    for t in (pool.k, pool.v):
        t.copy_(fmt.encode(torch.randn((*t.shape[:-1], layout.head_dim), generator=g) * 50))
    return pool


def run_garbage_peer(reports, layout: dict, fleet_key: bool = True) -> None:
    """A prefill peer that passes the handshake of a real decode instance (its ``layout``,
    from ``/disagg/info``) and answers every transfer with random KV. With ``fleet_key``
    False it holds a key pair of its own, not the fleet's: it reports its address without
    its key (where a decode instance expects the fleet's server key)."""
    from radixserve.disagg.zmq_sender import ZmqKVSender

    theirs = KVLayout.from_dict(layout)
    pool = garbage_pool(theirs)
    if fleet_key:
        sender = ZmqKVSender(pool, theirs, security=load_security())
        reports.put(sender.endpoint)
    else:
        own = CurveKeys.generate()
        sender = ZmqKVSender(pool, theirs, security=own)
        reports.put(sender.endpoint.partition("?")[0])
    while True:
        select.select([sender.fileno()], [], [], 0.05)
        for req in sender.incoming():
            sender.push(req.transfer_id, torch.arange(req.num_tokens) % 4096)
            reports.put(req.transfer_id)
        sender.finished()
