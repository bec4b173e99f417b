"""Graceful shutdown of ``dprouter serve``: SIGTERM drains, a second signal exits at once."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import completions_engine, serving
from tests.test_cli import _serve, listening

CHUNKS = 10


@pytest.fixture
async def slow_stream() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """Streams of ten events 0.1 s apart; ``started`` is set once 8 streams run."""
    started, running = asyncio.Event(), [0]

    async def stream(request: web.Request) -> web.StreamResponse:
        gap = (await request.json()).get("gap", 0.1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        running[0] += 1
        if running[0] >= 8:
            started.set()
        for i in range(CHUNKS):
            await resp.write(b'data: {"i": %d}\n\n' % i)
            await asyncio.sleep(gap)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = completions_engine(stream)
    async with serving(app) as url:
        yield url, started


async def read_stream(http: aiohttp.ClientSession, url: str, gap: float) -> tuple[int, bytes]:
    body = {"prompt": "drain me", "stream": True, "gap": gap}
    try:
        async with http.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.read()
    except aiohttp.ClientError as exc:
        return -1, repr(exc).encode()


@asynccontextmanager
async def streaming(
    slow_stream: tuple[str, asyncio.Event], http: aiohttp.ClientSession, grace: float, gap: float
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, list[asyncio.Task[tuple[int, bytes]]]]]:
    """``serve`` with ``--grace``, 8 streams running through it (events ``gap`` s apart);
    killed at the end if the test left it running."""
    upstream, started = slow_stream
    proc = await _serve("--worker", f"{upstream},dialect=vllm,dp_size=1", "--grace", str(grace))
    try:
        base, _ = await listening(proc)
        streams = [asyncio.create_task(read_stream(http, base, gap)) for _ in range(8)]
        await asyncio.wait_for(started.wait(), 10)
        yield proc, base, streams
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_sigterm_lets_every_stream_in_flight_finish_and_takes_no_new_ones(
    slow_stream: tuple[str, asyncio.Event], http: aiohttp.ClientSession
) -> None:
    async with streaming(slow_stream, http, grace=20, gap=0.1) as (proc, base, streams):
        proc.send_signal(signal.SIGTERM)
        refused = False
        async with asyncio.timeout(10):  # the listener closes at once
            while not refused:
                try:
                    async with aiohttp.ClientSession() as fresh, fresh.get(base + "/health") as r:
                        await r.read()
                except aiohttp.ClientConnectionError:
                    refused = True
                await asyncio.sleep(0.02)
        answers = await asyncio.gather(*streams)
        code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0
    for status, body in answers:  # every one complete: all events, then [DONE]
        assert status == 200 and body.count(b"data: ") == CHUNKS + 1, body
        assert body.endswith(b"data: [DONE]\n\n")


async def test_a_second_signal_exits_at_once(
    slow_stream: tuple[str, asyncio.Event], http: aiohttp.ClientSession
) -> None:
    async with streaming(slow_stream, http, grace=60, gap=3.0) as (proc, _, streams):
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 10)
        took = time.monotonic() - t0
        answers = await asyncio.wait_for(asyncio.gather(*streams), 10)
    assert code == 1 and took < 5  # not the 60 s grace nor the 30 s of streams
    assert all(body.count(b"data: ") < CHUNKS + 1 for _, body in answers)  # cut short
