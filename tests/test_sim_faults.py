"""Fault knobs of the simulated engines, and what a departing client leaves behind."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from dprouter.sim.model.config import EngineConfig, Faults
from tests.conftest import StartCluster
from tests.test_sim_vllm import metrics

RANK = "X-data-parallel-rank"
BODY = {"prompt": "fault", "max_tokens": 4}


async def status(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, object] = BODY,
    headers: dict[str, str] | None = None,
) -> int:
    async with http.post(url + "/v1/completions", json=body, headers=headers or {}) as r:
        await r.read()
        return r.status


async def test_fail_first_and_fail_rate(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    first, always = (
        await start_cluster(
            [
                EngineConfig(faults=Faults(fail_first=2)),
                EngineConfig(faults=Faults(fail_rate=1.0)),
            ]
        )
    ).servers
    assert [await status(http, first.url) for _ in range(3)] == [500, 500, 200]
    async with http.post(always.url + "/v1/completions", json=BODY) as r:
        assert r.status == 500
        assert (await r.json())["error"]["type"] == "InternalServerError"


async def test_hanging_engine_never_answers_but_stays_alive(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(faults=Faults(hang=True))])).servers
    timeout = aiohttp.ClientTimeout(total=0.3)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(engine.url + "/v1/completions", json=BODY, timeout=timeout) as r:
            await r.read()
    async with http.get(engine.url + "/health") as r:
        assert r.status == 200


async def test_crash_cuts_streams_refuses_connections_and_restarts(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(faults=Faults(crash_after=1))])).servers
    port = engine.port
    stream = await http.post(
        engine.url + "/v1/completions", json={"prompt": "long", "max_tokens": 500, "stream": True}
    )
    assert stream.status == 200
    await stream.content.readuntil(b"\n\n")
    with pytest.raises(aiohttp.ClientError):  # request 2 kills the engine
        await status(http, engine.url)
    with pytest.raises(aiohttp.ClientError):
        await stream.read()  # the stream in flight is cut, not finished
    stream.release()
    with pytest.raises(aiohttp.ClientConnectionError):
        await status(http, engine.url)
    await engine.start()  # a restarted engine comes back on the same port, empty
    assert engine.port == port
    assert await status(http, engine.url) == 200


async def test_slow_rank_takes_longer(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    config = EngineConfig(dp_size=2, faults=Faults(slow_ranks={1: 6.0}))
    (engine,) = (await start_cluster([config])).servers

    async def timed(rank: int) -> float:
        t0 = time.perf_counter()
        assert (
            await status(http, engine.url, {"prompt": "x", "max_tokens": 24}, {RANK: str(rank)})
            == 200
        )
        return time.perf_counter() - t0

    fast, slow = await timed(0), await timed(1)
    assert slow > 3 * fast, (fast, slow)
    assert engine.engine.ranks[1].stats.busy_time > 5 * engine.engine.ranks[0].stats.busy_time


async def test_health_fails_after_the_configured_time(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    sick, well = (
        await start_cluster(
            [
                EngineConfig(faults=Faults(health_fail_after=0.0)),
                EngineConfig(),
            ]
        )
    ).servers
    async with http.get(sick.url + "/health") as r:
        assert r.status == 503
    async with http.get(well.url + "/health") as r:
        assert r.status == 200


async def test_client_disconnect_aborts_generation(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    body = {"prompt": "endless", "max_tokens": 5000, "stream": True}
    resp = await http.post(engine.url + "/v1/completions", json=body, headers={RANK: "1"})
    await resp.content.readuntil(b"\n\n")
    assert engine.engine.ranks[1].num_running == 1
    resp.close()  # the client goes away mid-stream
    for _ in range(100):
        if engine.engine.ranks[1].num_running == 0:
            break
        await asyncio.sleep(0.01)
    m = await metrics(http, engine.url)
    assert m[("vllm:num_requests_running", "1")] == 0
    assert m[("vllm:kv_cache_usage_perc", "1")] == 0
    assert engine.engine.ranks[1].stats.aborted == 1
    assert engine.engine.ranks[1].stats.generation_tokens < 5000
