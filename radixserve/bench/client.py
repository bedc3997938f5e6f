"""HTTP client side of the benchmark: one streamed request, server checks, metric scrapes.

Talks to any OpenAI-compatible server. ``stream_request`` sends one streaming request with
``stream_options.include_usage`` and times it from the server-sent events (``data: ...``
lines). Token counts come only from the final ``usage`` object; a field the server does not
send is recorded as None, never guessed. Every failure (refused connection, HTTP error, an
``error`` event, a stream cut short, the overall timeout) becomes a record with
``success=False`` and a message; nothing raises out of a request. ``check_server`` fails fast
with a ``BenchError`` when the server is unreachable, unhealthy or refuses us.

Timing: TTFT is from sending the request to the first chunk with text; a request that ends
with no text at all takes the time of its finishing chunk instead. Inter-token latencies are
the gaps between chunks with text (a chunk may carry more than one token, so TPOT is computed
from the usage count: ``(e2e - ttft) / (output_tokens - 1)``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

HEALTH_TIMEOUT_S = 5.0


class BenchError(RuntimeError):
    """A benchmark cannot go on; the message says why in the user's terms."""


@dataclass
class RequestRecord:
    conversation_id: str
    turn: int  # 1-based
    start_time: float  # seconds since the measured phase began
    success: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    response_id: str | None = None  # the server's "id" of the response, where it gives one

    @property
    def end_time(self) -> float | None:
        return None if self.e2e is None else self.start_time + self.e2e

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or not self.output_tokens:
            return None
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def describe(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if text != type(e).__name__ else text


async def check_server(client: httpx.AsyncClient, base_url: str) -> str:
    """Fail fast unless the server answers; return the id of the model it serves."""
    try:
        health = await client.get(f"{base_url}/health", timeout=HEALTH_TIMEOUT_S)
        if health.status_code not in (200, 404):  # a server without /health is fine
            raise BenchError(
                f"{base_url}/health answered HTTP {health.status_code}: {health.text[:300]}"
            )
        models = await client.get(f"{base_url}/v1/models", timeout=HEALTH_TIMEOUT_S)
    except httpx.TimeoutException as e:
        raise BenchError(f"{base_url} did not answer within {HEALTH_TIMEOUT_S:g} s") from e
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {base_url}: {describe(e)}") from e
    if models.status_code in (401, 403):
        raise BenchError(f"{base_url} refused us (HTTP {models.status_code}): check --api-key")
    if models.status_code != 200:
        raise BenchError(
            f"{base_url}/v1/models answered HTTP {models.status_code}: {models.text[:300]}"
        )
    try:
        return str(models.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"{base_url}/v1/models lists no model: {models.text[:300]}") from e


async def flush_cache(client: httpx.AsyncClient, base_url: str) -> bool:
    """Empty the server's prefix cache (``POST /flush_cache``); False where unsupported."""
    try:
        r = await client.post(f"{base_url}/flush_cache", timeout=HEALTH_TIMEOUT_S * 6)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def request_body(api: str, model: str, content: Any, max_tokens: int, temperature: float) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body["messages" if api == "chat" else "prompt"] = content
    return body


async def stream_request(
    client: httpx.AsyncClient, base_url: str, api: str, body: dict, record: RequestRecord
) -> str:
    """Send one streaming request, fill ``record`` in, return the answer's text.

    The caller bounds the time (the client's read timeout and an overall deadline); a
    ``TimeoutError`` raised by the caller's deadline is caught by the caller.
    """
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    parts: list[str] = []
    token_times: list[float] = []
    usage: dict[str, Any] | None = None
    finish_time = None
    done = False
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", base_url + path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {text[:500]}"
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                now = time.perf_counter()
                if "error" in event:
                    record.error = f"error event: {json.dumps(event['error'])[:500]}"
                    return "".join(parts)
                usage = event.get("usage") or usage
                record.response_id = record.response_id or event.get("id")
                for choice in event.get("choices") or []:
                    if api == "chat":
                        piece = (choice.get("delta") or {}).get("content")
                    else:
                        piece = choice.get("text")
                    if piece:
                        parts.append(piece)
                        token_times.append(now)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                        finish_time = now
    except httpx.HTTPError as e:
        record.error = describe(e)
        return "".join(parts)
    except (json.JSONDecodeError, AttributeError) as e:
        record.error = f"unreadable stream event: {describe(e)}"
        return "".join(parts)
    end = time.perf_counter()
    if not done and finish_time is None:
        record.error = "the stream ended before the answer finished"
        return "".join(parts)
    first = token_times[0] if token_times else (finish_time or end)
    record.ttft = first - t0
    record.e2e = end - t0
    record.itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    fill_usage(record, usage)
    record.success = True
    return "".join(parts)


def fill_usage(record: RequestRecord, usage: dict[str, Any] | None) -> None:
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    record.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
    record.output_tokens = _int_or_none(usage.get("completion_tokens"))
    record.cached_tokens = _int_or_none(details.get("cached_tokens"))


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


METRIC_PREFIXES = ("radix_", "kv_cache_", "num_running_reqs", "num_queue_reqs", "llamacpp:")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> ``{name: value}`` for the metrics we watch (labels summed)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ") if "{" not in line else line.partition("}")
        name = name_part.split("{", 1)[0].strip()
        if not name.startswith(METRIC_PREFIXES) or name.endswith(("_created", "_bucket")):
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        values[name] = values.get(name, 0.0) + value
    return values
