"""Shared by the tests of the agent APIs (Messages, Responses): the server's flags (two
tenants, an admin key, a small body limit and context), an SSE reader, and the check that
the server is whole after a scenario."""

from __future__ import annotations

import json

import httpx

KEYS = ["agent-key-a", "agent-key-b"]
ADMIN = {"Authorization": "Bearer agent-admin"}
MAX_REQUEST_BYTES = 1 << 18
CONTEXT = 640  # --max-model-len: small, so max_tokens is lowered to it quickly


def agent_server_flags(model_dir) -> list[str]:
    return f"""--model {model_dir} --dtype float32 --served-model-name tiny
        --max-total-tokens 4096 --max-model-len {CONTEXT} --api-key {KEYS[0]}
        --api-key {KEYS[1]} --admin-key agent-admin --max-request-bytes {MAX_REQUEST_BYTES}
        --stored-responses 4""".split()


def sse_events(text: str) -> list[tuple[str, dict]]:
    """The ``(event name, data)`` pairs of a stream of named server-sent events."""
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        events.append((fields.get("event", ""), json.loads(fields["data"])))
    return events


def assert_whole(url: str) -> None:
    """Healthy, and the cache's bookkeeping holds (``check_integrity``)."""
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    r = httpx.get(url + "/debug/check_integrity", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
