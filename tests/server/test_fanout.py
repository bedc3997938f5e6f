"""Fan-out: all the engine requests of one HTTP request (``n`` choices, a batch of prompts)
reach the engine together, so they are prefilled in one step (the step trace shows it), and
the engine takes them all or none: a refused one, or a caller that gives up waiting, leaves
nothing running."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from radixserve.config import EngineConfig
from radixserve.engine import SamplingParams
from radixserve.engine.spec import RequestSpec
from radixserve.server.engine_client import EngineClient
from testing.server import read_metrics, started_server, wait_idle


@pytest.fixture(scope="module")
def traced(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("fanout") / "steps.jsonl"
    flags = f"--model {tiny_model_dir} --dtype float32 --max-total-tokens 8192 --step-trace {path}"
    with started_server(*flags.split()) as server:
        yield server.url, path


def completions(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def trace_of(path, request_ids: list[str]) -> tuple[list[dict], list[dict]]:
    """The ``add`` lines of these requests, and the steps that gave any of them a token."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    adds = [entry for entry in lines if entry.get("add") in request_ids]
    firsts = [e for e in lines if "step" in e and set(e["first"]) & set(request_ids)]
    return adds, firsts


def engine_ids(response: httpx.Response, count: int) -> list[str]:
    """The engine's ids of a response's sequences (``server/serving.py``: BASE-i)."""
    base = response.json()["id"].rsplit("-", 1)[-1]
    return [f"{base}-{i}" for i in range(count)]


def test_n_choices_are_prefilled_in_one_step(traced):
    url, path = traced
    body = {"prompt": "four choices share one prefill step " * 3, "n": 4, "max_tokens": 3,
            "temperature": 0.8, "ignore_eos": True}  # fmt: skip
    r = completions(url, body)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
    ids = engine_ids(r, 4)
    adds, firsts = trace_of(path, ids)
    assert len(adds) == 4 and len({a["received"] for a in adds}) == 1  # read as one message
    assert len(firsts) == 1, firsts  # every choice's first token came from the same step
    step = firsts[0]
    assert sorted(step["first"]) == sorted(ids)
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert step["prefills"] == [[prompt_tokens, 0]] * 4 and step["decodes"] == []


def test_the_choices_of_a_long_prompt_compute_it_once_then_start_together(traced):
    """Past the scheduler's in-flight prefix threshold the prompt is computed once: the other
    choices wait one step for it and then start together, each from the cache."""
    url, path = traced
    body = {"prompt": "a long prompt that all the choices share " * 12, "n": 4,
            "max_tokens": 3, "temperature": 0.8, "ignore_eos": True}  # fmt: skip
    r = completions(url, body)
    assert r.status_code == 200, r.text
    ids = engine_ids(r, 4)
    adds, firsts = trace_of(path, ids)
    assert len({a["received"] for a in adds}) == 1
    n = r.json()["usage"]["prompt_tokens"]  # the prompt's, counted once for its choices
    assert n > 64 and len(firsts) == 2, firsts
    assert firsts[0]["prefills"] == [[n, 0]] and len(firsts[0]["first"]) == 1
    assert firsts[1]["prefills"] == [[1, n - 1]] * 3 and len(firsts[1]["first"]) == 3


def test_a_batch_of_prompts_is_prefilled_in_one_step(traced):
    url, path = traced
    prompts = ["alpha " * 5, "the second prompt of the batch " * 4, "gamma delta " * 9]
    r = completions(url, {"prompt": prompts, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ids = engine_ids(r, 3)
    adds, firsts = trace_of(path, ids)
    assert len(adds) == 3 and len({a["received"] for a in adds}) == 1
    assert len(firsts) == 1 and sorted(firsts[0]["first"]) == sorted(ids)
    prefills = firsts[0]["prefills"]
    assert len(prefills) == 3 and all(position == 0 for _, position in prefills)
    assert sum(tokens for tokens, _ in prefills) == r.json()["usage"]["prompt_tokens"]
    assert len({tokens for tokens, _ in prefills}) == 3  # three prompts, three lengths


def test_a_refused_prompt_fails_the_request_and_runs_none_of_it(traced):
    url, _ = traced
    before = read_metrics(url, {})["generation_tokens_total"]
    # the first prompt fits; the second plus max_tokens does not fit the 2048-token context
    body = {"prompt": ["a short one", "word " * 1900], "max_tokens": 200, "ignore_eos": True}
    r = completions(url, body)
    assert r.status_code == 400, r.text
    assert "plus max_tokens (200) exceeds the model's context" in r.json()["error"]["message"]
    time.sleep(0.5)  # a sibling left running would have made tokens by now
    m = wait_idle(url, {})
    assert m["generation_tokens_total"] == before
    assert m["kv_cache_used_tokens"] == m["radix_cache_cached_tokens"]  # none held
    ok = completions(url, {"prompt": ["a short one", "another"], "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_a_caller_that_gives_up_waiting_leaves_nothing_running(tiny_model_dir):
    config = EngineConfig.from_options(
        model=str(tiny_model_dir), dtype="float32", max_total_tokens=2048
    )
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def main():
        client = EngineClient(config, on_stats=lambda *_: None)
        await client.start()
        try:
            queue: asyncio.Queue = asyncio.Queue()
            specs = [RequestSpec(request_id=f"gone-{i}", prompt_ids=[5, 6, 7, 8], params=params)
                     for i in range(4)]  # fmt: skip
            adding = asyncio.create_task(client.add(specs, queue))
            await asyncio.sleep(0)  # sent; the engine has not answered yet
            adding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await adding
            assert client.num_inflight == 0
            await asyncio.sleep(0.5)
            stats = await client.call("stats")
            assert stats.num_running == stats.num_waiting == 0
            assert await client.call("check_integrity")
            # the engine took and aborted them: their ids are free again, and they run
            await client.add(specs[:1], queue)
            index, out = await queue.get()
            assert index == 0 and out.request_id == "gone-0"
        finally:
            await client.close()

    asyncio.run(main())
