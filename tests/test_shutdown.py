"""Graceful shutdown of ``dprouter serve``: SIGTERM drains, a second signal exits at once."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.server.router import Router
from dprouter.sim.model.config import EngineConfig, PdConfig
from tests.conftest import StartCluster, completions_engine, serving, until
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


async def listener_closed(base: str) -> None:
    """Return once a new connection to ``base`` is refused (within 10 s)."""
    async with asyncio.timeout(10):
        while True:
            try:
                async with aiohttp.ClientSession() as fresh, fresh.get(base + "/health") as r:
                    await r.read()
            except aiohttp.ClientConnectionError:
                return
            await asyncio.sleep(0.02)


async def test_sigterm_lets_every_stream_in_flight_finish_and_takes_no_new_ones(
    slow_stream: tuple[str, asyncio.Event], http: aiohttp.ClientSession
) -> None:
    async with streaming(slow_stream, http, grace=20, gap=0.1) as (proc, base, streams):
        proc.send_signal(signal.SIGTERM)
        await listener_closed(base)  # at once
        answers = await asyncio.gather(*streams)
        code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0
    for status, body in answers:  # every one complete: all events, then [DONE]
        assert status == 200 and body.count(b"data: ") == CHUNKS + 1, body
        assert body.endswith(b"data: [DONE]\n\n")


async def test_a_second_signal_exits_at_once(
    slow_stream: tuple[str, asyncio.Event], http: aiohttp.ClientSession
) -> None:
    async with streaming(slow_stream, http, grace=60, gap=3.0) as (proc, base, streams):
        proc.send_signal(signal.SIGTERM)
        await listener_closed(base)  # the first signal was taken
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 10)
        took = time.monotonic() - t0
        answers = await asyncio.wait_for(asyncio.gather(*streams), 10)
    assert code == 1 and took < 5  # not the 60 s grace nor the 30 s of streams
    assert all(body.count(b"data: ") < CHUNKS + 1 for _, body in answers)  # cut short


@pytest.mark.parametrize("path", ["plain", "pd"])
async def test_when_the_grace_runs_out_streams_end_with_an_error_event_on_time(
    start_cluster: StartCluster, http: aiohttp.ClientSession, path: str
) -> None:
    """``grace`` seconds after the stop, no sooner and no later (±0.5 s), a stream still
    running ends with an error event and ``[DONE]``; meanwhile a new request on a kept-alive
    connection hears 503 with ``Connection: close`` and ``Retry-After``, not a reset."""
    slow = EngineConfig(time_scale=5.0)  # 200 tokens: about 6 s of stream
    if path == "plain":
        (engine,) = (await start_cluster([slow])).servers
        config = RouterConfig(workers=(WorkerSpec(engine.url),), grace=1.0, port=0)
    else:
        pd = [PdConfig(mode="sglang", role=r) for r in ("prefill", "decode")]
        prefill, decode = (
            await start_cluster([replace(slow, persona="sglang", pd=p) for p in pd])
        ).servers
        specs = (WorkerSpec(prefill.url, role="prefill"), WorkerSpec(decode.url, role="decode"))
        config = RouterConfig(workers=specs, pd="sglang", grace=1.0, port=0)
    router = Router(config)
    await router.start()
    assert await router.settled(10)
    body = {"prompt": "keep talking", "max_tokens": 200, "stream": True}
    loop = asyncio.get_running_loop()

    async def stream() -> tuple[float, bytes]:
        async with http.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            first = await r.content.readany()
            started.release()
            rest = await r.read()
            return loop.time(), first + rest

    started = asyncio.Semaphore(0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as kept:
        async with kept.get(router.url + "/health") as r:
            await r.read()  # its connection stays open, idle, in the pool
        streams = [asyncio.create_task(stream()) for _ in range(3)]
        for _ in streams:
            await asyncio.wait_for(started.acquire(), 10)
        t0 = loop.time()
        stopping = asyncio.create_task(router.stop())
        assert await until(lambda: router.parts.drain.draining)
        async with kept.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 503
            assert (r.headers["Connection"], r.headers["Retry-After"]) == ("close", "1")
            assert "stopping" in (await r.json())["error"]["message"]
        ends = await asyncio.gather(*streams)
        await asyncio.wait_for(stopping, 10)
    for ended, text in ends:
        assert 0.5 <= ended - t0 <= 1.5, ended - t0
        events = [e for e in text.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert b"grace period ran out" in events[-2] and b'"code":503' in events[-2]
        assert len(events) > 3  # tokens flowed before the cut
    assert router.parts.drain.cut == 3
    # and the engine was told: the connection closed (it stops), SGLang also asked to abort
    engine = decode if path == "pd" else engine
    assert await until(lambda: engine.active == 0)
    if path == "pd":
        assert await until(lambda: len(decode.abort_requests) == 3)
