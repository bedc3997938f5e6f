"""``radixserve serve --dp 2``: two real instances (tiny model, free ports) under the
supervisor, the router in front on one port.

One fleet serves the tests in order; the last ones kill instances (and watch one come back).
"""

import asyncio
import json
import os
import re
import signal

import httpx
import pytest

from testing.fleet import idle, pid_of_server, start_dp, stopping, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CHAT = "/v1/chat/completions"


class Instance:
    def __init__(self, url):
        self.url = url
        self.killed: int | None = None

    def kill(self):
        self.killed = pid_of_server(self.url)
        os.kill(self.killed, signal.SIGKILL)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    router = start_dp(tiny_model_dir, 2)
    with stopping(router):
        listed = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
        assert len(listed) == 2 and all(w["kv_events"]["block_size"] == 16 for w in listed)
        yield router, [Instance(w["url"]) for w in listed]
    for w in listed:  # the instances stop with the front process
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{w['url']}/health", timeout=2)


def running(url):
    try:
        return pid_of_server(url)
    except LookupError:
        return None


def metric(text, name):
    return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])


def model_of(url):
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def chat(url, model, messages, stream=False, **extra):
    body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0,
            "stream": stream, **extra}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(url + CHAT, json=body, timeout=120)
    return r


def usage_of(r, stream):
    if not stream:
        return r.json()["usage"]
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    return [e for e in events if e.get("usage")][-1]["usage"]


def test_turns_stick_to_a_worker_and_counters_return_to_zero(fleet):
    router, workers = fleet
    model = model_of(router.url)
    homes = {}
    for turn in range(3):
        for c in range(4):
            history = [{"role": "system", "content": f"conversation {c} " + "lorem ipsum " * 20}]
            for t in range(turn + 1):
                history.append({"role": "user", "content": f"question {t} of chat {c}"})
                if t < turn:
                    history.append({"role": "assistant", "content": f"answer {t}"})
            stream = (c + turn) % 2 == 1
            r = chat(router.url, model, history, stream=stream)
            assert r.status_code == 200, r.text
            worker = r.headers["x-radixserve-worker"]
            assert homes.setdefault(c, worker) == worker, f"chat {c} moved at turn {turn}"
            usage = usage_of(r, stream)
            if turn:
                assert usage["prompt_tokens_details"]["cached_tokens"] > 100
    assert set(homes.values()) == {w.url for w in workers}  # new chats spread
    wait_for(lambda: idle(router.url))
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    reported = metric(metrics, "radix_router_reported_cached_tokens_total")
    confirmed = metric(metrics, "radix_router_confirmed_cached_tokens_total")
    assert reported > 800 and confirmed > 0.9 * reported  # the predictions were right
    assert re.search(r'radix_router_index_entries\{kind="exact"\} [1-9]', metrics)


def test_bad_input_passes_through_and_unknown_models_are_404(fleet):
    router, workers = fleet
    model = model_of(router.url)
    bad = chat(router.url, model, [{"role": "user", "content": "hi"}], max_tokens=-3)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    direct = chat(workers[0].url, model, [{"role": "user", "content": "hi"}])
    assert direct.status_code == 401  # the instances answer the router only
    r = httpx.post(router.url + CHAT, content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = chat(router.url, "no-such-model", [{"role": "user", "content": "hi"}])
    assert r.status_code == 404 and "this router serves" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "model_not_found"
    wait_for(lambda: idle(router.url))


def test_aborted_streams_release_their_load(fleet):
    router, _ = fleet
    model = model_of(router.url)

    async def abort_after_first_chunk(i):
        body = {"model": model, "messages": [{"role": "user", "content": f"count {i}"}],
                "max_tokens": 200, "stream": True, "ignore_eos": True}  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", router.url + CHAT, json=body) as r:
                async for _ in r.aiter_bytes():
                    break  # the client goes away mid-stream

    async def main():
        await asyncio.gather(*(abort_after_first_chunk(i) for i in range(4)))

    asyncio.run(main())
    wait_for(lambda: idle(router.url), timeout=30)


def test_workers_join_and_leave_at_run_time(fleet, tiny_model_dir):
    router, workers = fleet
    r = httpx.delete(f"{router.url}/workers", params={"url": workers[1].url}, timeout=10)
    assert r.status_code == 200
    listed = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    assert [w["url"] for w in listed] == [workers[0].url]
    model = model_of(router.url)
    for i in range(3):
        r = chat(router.url, model, [{"role": "user", "content": f"only one {i}"}])
        assert r.headers["x-radixserve-worker"] == workers[0].url
    r = httpx.post(f"{router.url}/workers", json={"url": workers[1].url}, timeout=30)
    assert r.status_code == 201 and r.json()["kv_events"]["block_size"] == 16
    r = httpx.post(f"{router.url}/workers", json={"url": "http://127.0.0.1:9"}, timeout=30)
    assert r.status_code == 400 and "cannot add worker" in r.json()["error"]["message"]
    assert len(httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]) == 2


def test_a_killed_worker_loses_no_request_that_had_not_streamed(fleet):
    router, workers = fleet
    model = model_of(router.url)

    async def one(client, i):
        text = f"request {i} " + "word " * 60
        body = {"model": model, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": text}]}  # fmt: skip
        r = await client.post(router.url + CHAT, json=body)
        return r.status_code, r.headers.get("x-radixserve-worker")

    async def main():
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(12)]
            # requests are in flight on both workers (none can finish 300 tokens this soon)
            await asyncio.sleep(0.5)
            workers[1].kill()
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert [status for status, _ in results] == [200] * 12
    assert {w for _, w in results} == {workers[0].url}  # retried on the live worker
    wait_for(lambda: idle(router.url))
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert metric(metrics, "radix_router_retries_total") >= 1


def test_a_killed_instance_is_reaped_and_the_fleet_reports_degraded(fleet):
    """``/health`` says degraded (still 200: the fleet serves) while an instance is down,
    and the dead process is reaped at once (the supervisor starts it again)."""
    router, workers = fleet
    wait_for(lambda: running(workers[1].url))  # the previous test's kill may be restarting
    workers[1].kill()
    old = workers[1].killed
    wait_for(lambda: not os.path.exists(f"/proc/{old}"), timeout=10)  # reaped, no zombie

    def degraded():
        r = httpx.get(f"{router.url}/health", timeout=10)
        return r.status_code == 200 and r.json()["status"] == "degraded" and r.json()

    assert wait_for(degraded, timeout=20) == {"status": "degraded", "workers": 1, "unhealthy": 1}


@pytest.mark.slow
def test_a_killed_instance_comes_back(fleet):
    """After the previous test's kill -9: the instance runs again on its port, rejoins the
    fleet (healthy, its KV events followed) and serves requests."""
    router, workers = fleet

    def ok():
        return httpx.get(f"{router.url}/health", timeout=10).json()["status"] == "ok"

    wait_for(ok, timeout=180)
    assert pid_of_server(workers[1].url) != workers[1].killed
    listed = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    assert all(w["healthy"] and w["kv_events"] for w in listed)
    r = httpx.delete(f"{router.url}/workers", params={"url": workers[0].url}, timeout=10)
    assert r.status_code == 200
    r = chat(router.url, model_of(router.url), [{"role": "user", "content": "back again"}])
    assert r.status_code == 200 and r.headers["x-radixserve-worker"] == workers[1].url
