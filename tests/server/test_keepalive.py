"""A stream that has nothing to say for a while (a long prompt being prefilled) says it is
alive: ``with_keepalives`` interleaves a marker after each silent interval, passes every
item through in order, and closes its source when the stream is dropped mid-wait; the
Messages and Responses streams open (with their usage) only once the request is admitted."""

from __future__ import annotations

import asyncio

from radixserve.engine.output import OutputTracker
from radixserve.engine.request import Usage
from radixserve.engine.sampling_params import SamplingParams
from radixserve.server import serving
from radixserve.server.messages_api import MessageEncoder
from radixserve.server.responses_api import ResponseEncoder
from radixserve.server.serving import Job


def collect(source, stop_after: int | None = None):
    async def run():
        got = []
        stream = serving.with_keepalives(source)
        async for item in stream:
            got.append(item)
            if stop_after is not None and len(got) == stop_after:
                await stream.aclose()  # as Starlette does when the client goes
                break
        return got

    return asyncio.run(run())


def test_silence_becomes_keepalives_and_items_pass_in_order(monkeypatch):
    monkeypatch.setattr(serving, "KEEPALIVE_SECONDS", 0.05)

    async def source():
        yield 0
        await asyncio.sleep(0.18)  # three intervals of silence
        yield 1
        yield 2

    got = collect(source())
    assert [x for x in got if x is not None] == [0, 1, 2]
    assert got[0] == 0 and got.count(None) >= 2 and got[-2:] == [1, 2]


def test_a_dropped_stream_closes_its_source_while_a_read_waits(monkeypatch):
    monkeypatch.setattr(serving, "KEEPALIVE_SECONDS", 0.02)
    closed = []

    async def source():
        try:
            yield 0
            await asyncio.sleep(60)  # the engine has not answered yet
            yield 1
        finally:
            closed.append(True)

    assert collect(source(), stop_after=2) == [0, None]
    assert closed == [True]


def test_an_error_in_the_source_reaches_the_stream(monkeypatch):
    monkeypatch.setattr(serving, "KEEPALIVE_SECONDS", 0.02)

    async def source():
        yield 0
        await asyncio.sleep(0.05)
        raise ValueError("engine gone")

    async def run():
        got = []
        try:
            async for item in serving.with_keepalives(source()):
                got.append(item)
        except ValueError as e:
            return got, str(e)
        return got, None

    got, error = asyncio.run(run())
    assert got[0] == 0 and None in got and error == "engine gone"


def waiting_job() -> Job:
    tracker = OutputTracker("r", None, SamplingParams())  # no text: no tokenizer needed
    return Job("msg", [[5, 6, 7, 8]], [tracker], ["r"], response_id="msg-0")


def test_a_message_stream_opens_only_once_its_request_is_admitted():
    """Before admission its usage is unknown: pings only, never a message_start saying 0
    cached; once admitted, message_start with the cache hit, then pings."""
    job, encoder = waiting_job(), MessageEncoder("m", None)
    assert encoder.idle(job) == encoder.idle(job) == [{"type": "ping"}]
    job.trackers[0].usage = Usage(prompt_tokens=4, cached_tokens=3, admitted=True)
    opening = encoder.idle(job)
    assert [e["type"] for e in opening] == ["message_start", "ping"]
    usage = opening[0]["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (1, 3)
    assert encoder.idle(job) == [{"type": "ping"}]


def test_a_response_stream_opens_only_once_its_request_is_admitted():
    job, encoder = waiting_job(), ResponseEncoder("m", None, {}, {}, [])
    assert encoder.idle(job) == []  # the stream writes an SSE comment
    job.trackers[0].usage = Usage(prompt_tokens=4, cached_tokens=3, admitted=True)
    opening = encoder.idle(job)
    assert [e["type"] for e in opening] == ["response.created", "response.in_progress"]
    assert all(e["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 3
               for e in opening)  # fmt: skip
    assert encoder.idle(job) == []
