"""Ray Serve: a real local Ray cluster, two replicas of the tiny model, our request router.

The second turn of a conversation must land on the replica that holds the first."""

import socket

import httpx
import pytest

from testing.fleet import Proc, stopping

pytest.importorskip("ray.serve")
# A Ray cluster and two engine replicas take minutes to start on 2 busy cores (measured
# 190 s for this test with the machine shared): too long for CI.
pytestmark = pytest.mark.slow


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_second_turn_lands_on_the_replica_that_holds_the_first(tiny_model_dir, tmp_path):
    port = free_port()
    proc = Proc(
        ["ray-serve", "--model", str(tiny_model_dir), "--replicas", "2", "--replica-cpus", "0",
         "--port", str(port), "--dtype", "float32", "--max-total-tokens", "4096"],
        "radixserve on Ray Serve listening on",
    )  # fmt: skip
    with stopping(proc):
        proc.wait(timeout=400)
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        homes, seen = {}, set()
        for turn in range(2):
            for c in range(4):
                messages = [{"role": "system", "content": f"chat {c} " + "lorem ipsum " * 30},
                            {"role": "user", "content": "first question"}]  # fmt: skip
                if turn:
                    messages += [{"role": "assistant", "content": "an answer"},
                                 {"role": "user", "content": "second question"}]  # fmt: skip
                body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
                r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                replica = r.headers["x-radixserve-worker"]
                seen.add(replica)
                assert homes.setdefault(c, replica) == replica, f"chat {c} moved"
                if turn:
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
        assert len(seen) == 2  # new conversations went to both replicas
