"""A server with every tier and KV events under operators' faults (tiny model, real processes).

One server (page size 16, a host tier, a file store, KV events, keys) serves the module:

- KV-event subscribers connecting and leaving over and over while three clients chat: no
  request fails (a storage write-out that lands after the last subscriber left has no event
  to announce, and must not fail the step).
- ``/clear_kv_storage`` on a store that cannot delete (a read-only file system) is a 503 that
  says why, and the metrics go on counting the pages that remain.
- The last test signals the server's whole process group (a terminal's Ctrl-C, ``kill -TERM
  -PGID``): the four running requests finish, the engine is never restarted, the exit is 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import zmq

from radixserve.links.keys import load_security
from testing.server import read_metrics, started_server
from testing.storage import can_mount, remount_read_only, remount_read_write, tmpfs

KEY, ADMIN_KEY = "tenant-key", "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PAGE = 16


def flags(model_dir, store) -> list[str]:
    return f"""--model {model_dir} --dtype float32 --page-size {PAGE} --max-total-tokens 2048
        --host-kv-memory 8MiB --kv-storage file://{store} --chunked-prefill-size 128
        --kv-events-endpoint tcp://127.0.0.1:0 --api-key {KEY} --admin-key {ADMIN_KEY}
        --max-running-requests 8 --shutdown-timeout 120""".split()


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-store")
    with contextlib.ExitStack() as stack:
        if can_mount():  # a file system of its own, to make read-only later
            stack.enter_context(tmpfs(store, "64m"))
        server = stack.enter_context(
            started_server(*flags(tiny_model_dir, store), timeout=600, new_session=True)
        )
        server.store = store
        yield server


def generate(url: str, ids: list[int], max_tokens: int = 8) -> httpx.Response:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
    }
    return httpx.post(url + "/generate", json=body, headers=AUTH, timeout=300)  # fmt: skip


def assert_intact(url: str) -> None:
    r = httpx.get(url + "/debug/check_integrity", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text


def churn_subscribers(endpoint: str, server_key: str, stop: threading.Event) -> int:
    """Subscribe (with the fleet's key), listen a moment, leave; again until ``stop``.
    Returns the rounds done."""
    ctx, rounds = zmq.Context(), 0
    security = load_security()
    try:
        while not stop.is_set():
            sub = ctx.socket(zmq.SUB)
            security.client(sub, server_key.encode())
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            sub.poll(150)
            sub.close(linger=0)
            rounds += 1
            time.sleep(0.05)
    finally:
        ctx.term()
    return rounds


def chat_turns(url: str, seed: int, turns: int) -> list[int]:
    """A conversation of ``turns`` turns (each reuses the whole history); the statuses."""
    rng = np.random.default_rng(seed)
    history, statuses = rng.integers(100, 40000, 150).tolist(), []
    for _ in range(turns):
        r = generate(url, history)
        statuses.append(r.status_code)
        if r.status_code != 200:
            continue
        history += r.json()["output_ids"] + rng.integers(100, 40000, 24).tolist()
    return statuses


def test_kv_event_subscribers_coming_and_going_fail_no_request(srv):
    events = httpx.get(srv.url + "/kv_events", headers=ADMIN).json()
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        churn = pool.submit(churn_subscribers, events["endpoint"], events["curve_public_key"], stop)
        chats = [pool.submit(chat_turns, srv.url, seed, 6) for seed in range(3)]
        statuses = [s for c in chats for s in c.result(timeout=600)]
        stop.set()
        rounds = churn.result(timeout=60)
    assert statuses == [200] * 18 and rounds >= 3
    m = read_metrics(srv.url, AUTH)
    assert m["kv_storage_stored_pages"] > 0  # write-outs did happen meanwhile
    assert m["engine_restarts_total"] == 0
    assert_intact(srv.url)


@pytest.mark.skipif(not can_mount(), reason="needs root with the right to mount a tmpfs")
def test_clearing_a_store_that_cannot_delete_is_an_error_not_a_claim(srv):
    stored = read_metrics(srv.url, AUTH)["kv_storage_stored_pages"]
    assert stored > 0
    remount_read_only(srv.store)
    try:
        r = httpx.post(srv.url + "/clear_kv_storage", headers=ADMIN, timeout=120)
    finally:
        remount_read_write(srv.store)
    assert r.status_code == 503, r.text
    assert "Read-only file system" in r.json()["error"]["message"]
    assert read_metrics(srv.url, AUTH)["kv_storage_stored_pages"] == stored
    assert len(list(srv.store.rglob("*.kv"))) == stored
    r = httpx.post(srv.url + "/clear_kv_storage", headers=ADMIN, timeout=120)
    assert r.status_code == 200 and r.json() == {"cleared": True}
    assert read_metrics(srv.url, AUTH)["kv_storage_stored_pages"] == 0
    assert not list(srv.store.rglob("*.kv"))


def wait_running(url: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while read_metrics(url, AUTH)["num_running_reqs"] < n:
        assert time.monotonic() < deadline, f"{n} requests never ran at once"
        time.sleep(0.05)


def drains_on_a_group_signal(server, signum: int) -> None:
    """Four long requests run; the whole process group gets ``signum``: all four finish,
    the engine is not restarted and the server exits 0."""
    rng = np.random.default_rng(signum)
    prompts = [rng.integers(100, 40000, 40).tolist() for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # Long enough that all four are still decoding when the last one is admitted, even
        # on a busy machine (4 x 440 tokens fit the 2,048-token pool).
        running = [pool.submit(generate, server.url, p, 400) for p in prompts]
        wait_running(server.url, 4)
        os.killpg(server.proc.pid, signum)
        answers = [f.result(timeout=300) for f in running]
    assert [r.status_code for r in answers] == [200] * 4, [r.text[:200] for r in answers]
    assert all(len(r.json()["output_ids"]) == 400 for r in answers)
    assert server.proc.wait(timeout=120) == 0
    assert "restarting the engine" not in server.log and "died" not in server.log, server.log


# Last: it stops the module's server.
def test_a_sigterm_to_the_process_group_drains_the_running_requests(srv):
    drains_on_a_group_signal(srv, signal.SIGTERM)


@pytest.mark.slow  # a server of its own
def test_ctrl_c_drains_the_running_requests(tiny_model_dir, tmp_path):
    with started_server(*flags(tiny_model_dir, tmp_path), timeout=600, new_session=True) as s:
        drains_on_a_group_signal(s, signal.SIGINT)
