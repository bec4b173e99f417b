"""Fault injection through the router: what clients see when engines misbehave.

(Also here, elsewhere: a stream cut mid-way and a hanging engine in
test_router_proxy, a failing rank and failed health checks in
test_router_health, SIGTERM under load in test_shutdown.)
"""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.sim.model.config import EngineConfig, Faults
from tests.conftest import (
    StartCluster,
    StartRouter,
    completions_engine,
    metric_sum,
    serving,
    until,
    workers,
)

PROMPT = {"prompt": "fault injection", "max_tokens": 4}


async def test_ten_percent_upstream_failures_never_reach_the_clients(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    configs = [EngineConfig(dp_size=2, faults=Faults(fail_rate=0.1, seed=i)) for i in range(4)]
    cluster = await start_cluster(configs)
    # five tries: a request fails only if five targets fail it in a row (1e-5 each)
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), attempts=5))
    statuses: Counter[int] = Counter()
    gate = asyncio.Semaphore(16)

    async def one() -> None:
        async with gate, http.post(router.url + "/v1/completions", json=PROMPT) as r:
            await r.read()
            statuses[r.status] += 1

    await asyncio.gather(*(one() for _ in range(400)))
    assert statuses == {200: 400}
    failed = await metric_sum(http, router.url, "dprouter_upstream_errors_total")
    assert 15 <= failed <= 80  # about 10% of ~440 attempts failed, and were retried
    assert sum(s.generation_requests for s in cluster.servers) == 400 + failed
    assert all(t.outstanding == 0 for t in router.registry.targets())


async def test_a_slow_rank_gets_less_traffic_from_load_aware_policies(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    config = EngineConfig(dp_size=4, faults=Faults(slow_ranks={1: 8.0}), time_scale=0.5)
    (engine,) = (await start_cluster([config])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), policy="least_load"))
    ranks: Counter[str] = Counter()
    gate = asyncio.Semaphore(8)

    async def one() -> None:
        async with gate, http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200
            ranks[r.headers["x-sim-dp-rank"]] += 1

    await asyncio.gather(*(one() for _ in range(120)))
    others = [ranks[r] for r in ("0", "2", "3")]
    assert ranks["1"] < min(others) / 2, ranks  # its requests stay in flight longer


async def test_all_engines_down_is_a_clear_503_and_the_router_keeps_serving(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=2), EngineConfig(dp_size=2)])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    for server in cluster.servers:
        await server.crash()
    for _ in range(3):  # first the connections are refused, then no worker is left
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 503
            message = (await r.json())["error"]["message"]
            assert "no worker could be reached" in message or "no ready worker" in message
    async with http.get(router.url + "/health") as r:
        assert r.status == 200
    async with http.get(router.url + "/readiness") as r:
        assert r.status == 503
    await cluster.servers[1].start()  # back: re-admitted, served again
    assert await until(lambda: router.registry.workers["w1"].ready, 10)
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200 and r.headers["x-sim-engine"] == cluster.servers[1].engine_id


async def test_a_client_leaving_an_sglang_request_aborts_it_by_rid(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    config = EngineConfig(persona="sglang", dp_size=2, dp_attention=True)
    (engine,) = (await start_cluster([config])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    body = {"prompt": "a long story", "max_tokens": 5000}  # not streamed: nothing to notice
    leaving = asyncio.create_task(http.post(router.url + "/v1/completions", json=body))
    assert await until(lambda: any(r.num_running for r in engine.engine.ranks))
    leaving.cancel()
    assert await until(lambda: len(engine.abort_requests) == 1)
    (received,) = [r for r in engine.received if r.path == "/v1/completions"]
    assert engine.abort_requests[0] == received.body["rid"]  # the rid the router wrote
    assert received.body["rid"].startswith("dprouter-")
    assert await until(lambda: not any(r.num_running for r in engine.engine.ranks))
    assert all(t.outstanding == 0 for t in router.registry.targets())
    client_rid = {"prompt": "short", "max_tokens": 2, "rid": "mine-1"}
    async with http.post(router.url + "/v1/completions", json=client_rid) as r:
        assert r.status == 200
    assert engine.received[-1].body["rid"] == "mine-1"  # a client's own rid is kept


async def test_a_stream_past_the_total_timeout_ends_with_an_error_event(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(time_scale=1.0)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), total_timeout=0.5))
    body = {"prompt": "a long story", "max_tokens": 5000, "stream": True}
    async with http.post(router.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        data = await asyncio.wait_for(r.read(), 10)
    assert data.endswith(b"data: [DONE]\n\n") and b"ran past the read or total timeout" in data
    assert await until(lambda: not engine.engine.ranks[0].num_running)
    assert all(t.outstanding == 0 for t in router.registry.targets())


async def test_a_stream_silent_past_the_read_timeout_ends_with_an_error_event(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Events 0.2 s apart pass a 0.5 s read timeout; a silence past it ends the stream."""
    release = asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            await resp.write(b'data: {"i": %d}\n\n' % i)
            await asyncio.sleep(0.2)
        await release.wait()  # then silent
        return resp

    async with serving(completions_engine(completions)) as url:
        stand_in = workers(url, dialect="vllm", dp_size=1)
        router = await start_router(RouterConfig(workers=stand_in, read_timeout=0.5))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        body = {"prompt": "a long story", "stream": True}
        async with http.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            data = await asyncio.wait_for(r.read(), 10)
        elapsed = loop.time() - t0
        release.set()
    assert data.count(b'data: {"i": ') == 5
    assert data.endswith(b"data: [DONE]\n\n") and b"ran past the read or total timeout" in data
    assert 1.2 <= elapsed < 5  # 0.5 s after the last event, sent at 0.8 s
    errors = "dprouter_upstream_errors_total"
    assert await metric_sum(http, router.url, errors, cause="stream_timeout") == 1
    assert all(t.outstanding == 0 for t in router.registry.targets())


async def test_an_engine_that_never_starts_answering_is_left_after_the_first_byte_timeout(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    hung, fine = (
        await start_cluster([EngineConfig(faults=Faults(hang=True)), EngineConfig()])
    ).servers
    config = RouterConfig(workers=workers(hung.url, fine.url), first_byte_timeout=0.3)
    router = await start_router(config)  # the read timeout stays at its 600 s default
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200 and r.headers["x-sim-engine"] == fine.engine_id
    assert loop.time() - t0 < 5
    assert all(t.outstanding == 0 for t in router.registry.targets())
