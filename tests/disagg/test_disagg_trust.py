"""Who may choose a decode instance's prefill peer, and a configured peer that is dead.

One decode instance (tiny model, keys, ``--prefill-endpoint`` naming a closed port) and a
fake prefill peer that passes the instance's handshake and answers with random KV:

- A tenant naming that peer in ``X-Radixserve-Prefill`` gets a 400 and the instance never
  asks it: the next request for the same prompt has no cached tokens and the right answer.
- The admin key may name any peer (the router in prefill/decode mode); what that peer sends
  goes into the request's own cache namespace only, never another tenant's.
- The dead ``--prefill-endpoint`` costs the handshake timeout once; later requests are
  computed here at once while the peer stays dead.
- A peer at an address the instance is told of that does not hold the server key expected
  there (the fleet's) puts nothing into the tree, even named with the admin key.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import httpx
import numpy as np
import pytest

from testing.server import started_server
from testing.transfer_peer import run_garbage_peer

KEY, ADMIN_KEY = "tenant-key", "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
HANDSHAKE_TIMEOUT_S = 10.0  # 5 heartbeats of 2 s
CTX = mp.get_context("spawn")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def decode(tiny_model_dir):
    flags = f"""--model {tiny_model_dir} --dtype float32 --max-total-tokens 4096
        --served-model-name tiny --disaggregation-mode decode --remote-prefill-min-tokens 1
        --prefill-endpoint tcp://127.0.0.1:{closed_port()} --kv-transfer-heartbeat 2
        --api-key {KEY} --admin-key {ADMIN_KEY}"""
    with started_server(*flags.split(), timeout=600) as server:
        yield server.url


def start_garbage_peer(decode, fleet_key: bool):
    layout = httpx.get(decode + "/disagg/info", headers=AUTH).json()["layout"]
    reports = CTX.Queue()
    proc = CTX.Process(target=run_garbage_peer, args=(reports, layout, fleet_key), daemon=True)
    proc.start()
    try:
        endpoint = reports.get(timeout=120)
        yield endpoint, reports
    finally:
        proc.kill()
        proc.join(10)


@pytest.fixture(scope="module")
def garbage_peer(decode):
    yield from start_garbage_peer(decode, fleet_key=True)


@pytest.fixture(scope="module")
def keyless_peer(decode):
    yield from start_garbage_peer(decode, fleet_key=False)


def generate(url, ids, headers=AUTH, salt=None, prefill=None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 8}}
    if salt is not None:
        body["cache_salt"] = salt
    if prefill is not None:
        headers = {**headers, "X-Radixserve-Prefill": prefill}
    return httpx.post(url + "/generate", json=body, headers=headers, timeout=120)


def answer(r: httpx.Response) -> tuple[list[int], int]:
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, 80).tolist()


@pytest.mark.slow  # tens of seconds alone; runs in `make test-all`
def test_a_dead_prefill_endpoint_costs_its_timeout_once(decode):
    took = []
    for i in range(5):
        start = time.monotonic()
        answer(generate(decode, prompt(100 + i)))
        took.append(time.monotonic() - start)
    assert took[0] >= HANDSHAKE_TIMEOUT_S * 0.8, took  # the first found the peer dead
    assert max(took[1:]) < HANDSHAKE_TIMEOUT_S / 2, took  # the rest did not wait for it


@pytest.mark.slow  # seconds to tens of seconds alone; runs in `make test-all`
def test_a_tenant_cannot_name_a_prefill_peer(decode, garbage_peer):
    endpoint, reports = garbage_peer
    ids = prompt(1)
    want, _ = answer(generate(decode, ids, salt="reference"))  # computed here, apart
    r = generate(decode, ids, prefill=endpoint)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "X-Radixserve-Prefill"
    got, cached = answer(generate(decode, ids))
    assert (got, cached) == (want, 0)
    assert reports.empty()  # the peer was never asked
    assert answer(generate(decode, ids, prefill="local"))[0] == want  # "local" is anyone's


def test_an_admin_chosen_peer_fills_only_the_requests_own_namespace(decode, garbage_peer):
    endpoint, reports = garbage_peer
    ids = prompt(2)
    want, _ = answer(generate(decode, ids, salt="reference"))
    answer(generate(decode, ids, ADMIN, salt="quarantine", prefill=endpoint))
    assert reports.get(timeout=30)  # the peer was asked, and sent its garbage
    _, cached = answer(generate(decode, ids, ADMIN, salt="quarantine"))
    assert cached > 0  # the garbage sits in that namespace ...
    got, cached = answer(generate(decode, ids))
    assert (got, cached) == (want, 0)  # ... and nowhere else
    r = httpx.get(decode + "/debug/check_integrity", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.slow  # tens of seconds alone; runs in `make test-all`
def test_a_peer_without_the_fleet_key_puts_nothing_into_the_tree(decode, keyless_peer):
    endpoint, reports = keyless_peer
    ids = prompt(3)
    want, _ = answer(generate(decode, ids, salt="reference"))
    before = httpx.get(decode + "/disagg/info", headers=ADMIN).json()["stats"]
    got, cached = answer(generate(decode, ids, ADMIN, salt="quarantine", prefill=endpoint))
    assert (got, cached) == (want, 0)  # computed here, after the handshake went nowhere
    after = httpx.get(decode + "/disagg/info", headers=ADMIN).json()["stats"]
    assert after["transfers_failed"] == before["transfers_failed"] + 1
    assert after["bytes"] == before["bytes"]  # not one byte landed
    assert reports.empty()  # the peer never even got the request
    got, cached = answer(generate(decode, ids, ADMIN, salt="quarantine"))
    assert got == want and cached > 0  # what that namespace holds is this instance's own
    r = httpx.get(decode + "/debug/check_integrity", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
