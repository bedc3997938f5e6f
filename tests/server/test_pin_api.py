"""Pins through a real server (tiny model, a 4096-slot pool, pins up to a quarter of it):
``cache_control`` on the Messages API pins the system prompt, which keeps being served from
the cache while a flood of other prompts evicts an unpinned one; the OpenAI-style
``cache_pin`` field on chat completions and responses; ``/admin/pins`` pins, lists and
unpins; pins expire; ``/metrics`` and ``/cache`` show them; bad input is a 4xx in each API's
shape; the server is whole after each scenario."""

from __future__ import annotations

import time

import httpx
import pytest

from radixserve.api.guard import key_tenant
from testing.agents import ADMIN, KEYS, agent_server_flags, assert_whole
from testing.server import running_server

ANTHROPIC = {"x-api-key": KEYS[0], "anthropic-version": "2023-06-01"}
OPENAI = {"Authorization": f"Bearer {KEYS[0]}"}
TENANT = key_tenant(KEYS[0])


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    flags = agent_server_flags(tiny_model_dir) + ["--pin-budget", "0.25"]
    with running_server(*flags) as url:
        yield url


def system_text(word: str) -> str:
    return " ".join(f"{word} rule {i}: keep answers short." for i in range(30))


def messages_body(system, question: str, **extra):
    return {"model": "tiny", "max_tokens": 2, "temperature": 0, "system": system,
            "messages": [{"role": "user", "content": question}], **extra}  # fmt: skip


def post_messages(url, body):
    r = httpx.post(url + "/v1/messages", json=body, headers=ANTHROPIC, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def pins(url) -> dict:
    r = httpx.get(url + "/admin/pins", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def unpin_all(url) -> None:
    r = httpx.request("DELETE", url + "/admin/pins", json={"all": True}, headers=ADMIN)
    assert r.status_code == 200, r.text


def flood(url, n: int = 14) -> None:
    """Distinct prompts of ~420 tokens each: several times the pool's unpinned room."""
    for i in range(n):
        text = " ".join(f"w{i}x{j}" for j in range(80))
        body = {"model": "tiny", "prompt": text, "max_tokens": 1, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, headers=OPENAI, timeout=60)
        assert r.status_code == 200, r.text


def test_cache_control_pins_the_system_prompt_through_eviction_pressure(url):
    unpin_all(url)
    pinned = [{"type": "text", "text": system_text("alpha"),
               "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    plain = [{"type": "text", "text": system_text("beta")}]
    post_messages(url, messages_body(pinned, "first question"))
    post_messages(url, messages_body(plain, "first question"))
    listed = pins(url)
    assert [(p["tenant"], p["ttl"]) for p in listed["pins"]] == [(TENANT, 300.0)]
    system_tokens = listed["pins"][0]["tokens"]
    assert system_tokens > 100 and listed["pinned_tokens"] == system_tokens
    flood(url)
    hit = post_messages(url, messages_body(pinned, "another question"))
    miss = post_messages(url, messages_body(plain, "another question"))
    assert hit["cache_read_input_tokens"] >= system_tokens
    assert miss["cache_read_input_tokens"] < 50  # evicted (a few template tokens may match)
    metrics = httpx.get(url + "/metrics", headers=OPENAI, timeout=10).text
    assert f'radix_pinned_tokens_by_tenant{{model_name="tiny",tenant="{TENANT}"}} ' in metrics
    assert f'radix_pinned_tokens{{model_name="tiny"}} {float(system_tokens)}' in metrics
    cache = httpx.get(url + "/cache", headers=ADMIN, timeout=30).json()
    assert cache["pins"]["pinned_tokens"] == system_tokens and cache["pins"]["listed"]
    assert_whole(url)


def test_chat_completions_cache_pin_expires_on_time(url):
    unpin_all(url)
    body = {"model": "tiny", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system_text("gamma")},
                         {"role": "user", "content": "hi"}],
            "cache_pin": {"messages": 1, "ttl": 2}}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=OPENAI, timeout=60)
    assert r.status_code == 200, r.text
    (pin,) = pins(url)["pins"]
    assert pin["ttl"] == 2.0 and 0 < pin["expires_in"] <= 2.0 and pin["tokens"] > 100
    time.sleep(2.2)
    assert pins(url)["pins"] == []
    metrics = httpx.get(url + "/metrics", headers=OPENAI, timeout=10).text
    assert 'radix_pin_events_total{event="expired",model_name="tiny"} 1.0' in metrics
    assert_whole(url)


def test_responses_cache_pin_pins_the_whole_prompt(url):
    unpin_all(url)
    body = {"model": "tiny", "max_output_tokens": 1, "input": "hello there",
            "instructions": system_text("delta"), "store": False,
            "cache_pin": {"ttl": "1h"}}  # fmt: skip
    r = httpx.post(url + "/v1/responses", json=body, headers=OPENAI, timeout=60)
    assert r.status_code == 200, r.text
    (pin,) = pins(url)["pins"]
    assert pin["ttl"] == 3600.0 and pin["tokens"] >= r.json()["usage"]["input_tokens"] - 5
    assert_whole(url)


def test_admin_pins_a_text_prefix_lists_and_unpins_it(url):
    unpin_all(url)
    text = system_text("epsilon")
    r = httpx.post(url + "/admin/pins", json={"text": text, "ttl": 60}, headers=ADMIN)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["tenant"] == "" and pin["tokens"] > 100 and "head_hash" in pin
    assert [p["id"] for p in pins(url)["pins"]] == [pin["id"]]
    r = httpx.request("DELETE", url + "/admin/pins", json={"id": pin["id"]}, headers=ADMIN)
    assert r.json() == {"unpinned": 1} and pins(url)["pins"] == []
    assert_whole(url)


@pytest.mark.parametrize(
    "path, body, headers, status, words",
    [
        ("/v1/messages", {**messages_body("s", "q"), "messages": [{"role": "user", "content": [
            {"type": "text", "text": "q", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]}]},
         ANTHROPIC, 400, "ttl"),
        ("/v1/messages", messages_body([{"type": "text", "text": f"s{i}", "cache_control": {
            "type": "ephemeral"}} for i in range(5)], "q"), ANTHROPIC, 400, "maximum of 4"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
         "cache_pin": {"messages": 3}}, OPENAI, 400, "cache_pin"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
         "cache_pin": {"ttl": 7200}}, OPENAI, 400, "ttl"),
        ("/admin/pins", {"text": "w " * 2000}, ADMIN, 400, "budget"),
        ("/admin/pins", {"text": "a", "token_ids": [1]}, ADMIN, 400, "one of"),
        ("/admin/pins", {"text": "a"}, OPENAI, 403, ""),
    ],
)  # fmt: skip
def test_bad_pins_are_refused_in_the_api_shape(url, path, body, headers, status, words):
    r = httpx.post(url + path, json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and words in r.json()["error"]["message"]
    elif status == 400:
        assert words in r.json()["error"]["message"]
    assert_whole(url)
