"""Health: circuit breakers per target (one rank) and periodic health checks per worker."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.sim.model.config import EngineConfig, Faults
from tests.conftest import (
    CutsStreams,
    StartCluster,
    StartRouter,
    completions_engine,
    metric_sum,
    serving,
    stream_ends,
    until,
    workers,
)

PROMPT = {"prompt": "are you well", "max_tokens": 2}


async def test_a_failing_rank_is_taken_out_while_its_siblings_serve(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    faults = Faults(failing_ranks=frozenset({2}))
    (engine,) = (await start_cluster([EngineConfig(dp_size=4, faults=faults)])).servers
    router = await start_router(
        RouterConfig(workers=workers(engine.url), breaker_failures=2, breaker_cooldown=60)
    )
    served: Counter[str] = Counter()
    for _ in range(40):
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200  # the failed attempts were retried on a sibling rank
            served[r.headers["x-sim-dp-rank"]] += 1
    errors = await metric_sum(
        http, router.url, "dprouter_upstream_errors_total", worker="w0", dp_rank="2"
    )
    assert errors == 2  # then the breaker opened
    assert set(served) == {"0", "1", "3"} and sum(served.values()) == 40
    assert [t.label for t in router.registry.snapshot.pool()] == ["w0/0", "w0/1", "w0/3"]


@dataclass
class Flaky:
    url: str = ""
    broken: bool = True
    healthy: bool = True
    hits: int = 0
    checks: int = 0  # GET /health received
    slow_health: float = 0.0  # seconds /health takes to answer


@pytest.fixture
async def flaky() -> AsyncIterator[Flaky]:
    """A single-rank upstream that answers 503 while ``broken``; /health follows ``healthy``."""
    state = Flaky()

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        state.hits += 1
        if state.broken:
            return web.json_response({"error": "down"}, status=503)
        return web.json_response({"choices": [{"text": "ok"}]}, headers={"X-From": "flaky"})

    async def health(_: web.Request) -> web.Response:
        state.checks += 1
        await asyncio.sleep(state.slow_health)
        return web.Response(status=200 if state.healthy else 503)

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    async with serving(app) as url:
        state.url = url
        yield state


@pytest.fixture
async def steady() -> AsyncIterator[str]:
    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"text": "ok"}]}, headers={"X-From": "steady"})

    app = completions_engine(complete)
    async with serving(app) as url:
        yield url


async def test_an_open_breaker_goes_half_open_and_closes_on_success(
    flaky: Flaky, steady: str, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    specs = workers(flaky.url, steady, dialect="vllm", dp_size=1)
    config = RouterConfig(workers=specs, breaker_failures=1, breaker_cooldown=0.3)
    router = await start_router(config)

    def pool() -> list[str]:
        return [t.label for t in router.registry.snapshot.pool()]

    async def ready() -> list[float]:
        return [
            await metric_sum(http, router.url, "dprouter_worker_ready", worker=w)
            for w in ("w0", "w1")
        ]

    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200 and r.headers["X-From"] == "steady"  # retried
    assert pool() == ["w1"]
    assert await ready() == [0.0, 1.0]  # as routing sees it: none of its ranks takes traffic
    assert await until(lambda: pool() == ["w0", "w1"], 3)  # half-open after the cooldown
    assert await ready() == [1.0, 1.0]
    for _ in range(2):  # the trial fails: out again at once
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200
    assert pool() == ["w1"] and flaky.hits == 2
    flaky.broken = False
    assert await until(lambda: pool() == ["w0", "w1"], 3)
    sources = []
    for _ in range(4):  # the trial succeeds: closed, round robin over both again
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            sources.append(r.headers["X-From"])
    assert sorted(sources) == ["flaky", "flaky", "steady", "steady"] and pool() == ["w0", "w1"]


async def test_the_last_target_is_never_taken_out(
    flaky: Flaky, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    config = RouterConfig(workers=workers(flaky.url, dialect="vllm", dp_size=1), breaker_failures=1)
    router = await start_router(config)
    for _ in range(3):  # the engine's own answer passes through, every time
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 503
    assert [t.label for t in router.registry.snapshot.pool()] == ["w0"]
    flaky.broken = False
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200


async def test_failed_health_checks_take_a_worker_out_until_it_recovers(
    flaky: Flaky, steady: str, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    flaky.broken = False
    specs = workers(flaky.url, steady, dialect="vllm", dp_size=1)
    config = RouterConfig(workers=specs, health_interval=0.05, health_failures=2)
    router = await start_router(config)
    workers_ = router.registry.workers
    flaky.healthy = False
    assert await until(lambda: not workers_["w0"].ready, 3)
    for _ in range(4):
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.headers["X-From"] == "steady"
    checks = flaky.checks
    assert await until(lambda: flaky.checks >= checks + 3, 5)  # rediscovery asks again...
    assert not workers_["w0"].ready  # ...and waits for /health too: no flapping
    flaky.healthy = True
    assert await until(lambda: workers_["w0"].ready, 5)
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200


async def test_an_engine_whose_health_fails_is_taken_out(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    sick, well = (
        await start_cluster(
            [EngineConfig(faults=Faults(health_fail_after=0.0)), EngineConfig(dp_size=2)]
        )
    ).servers
    config = RouterConfig(
        workers=workers(sick.url, well.url), health_interval=0.05, health_failures=1
    )
    router = await start_router(config, settle=False)
    assert await until(lambda: router.registry.workers["w1"].ready, 5)
    sick_worker = router.registry.workers["w0"]
    assert await until(lambda: "GET /health answered 503" in (sick_worker.error or ""), 5)
    assert not sick_worker.ready  # never admitted: /health says 503
    for _ in range(4):
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.headers["x-sim-engine"] == well.engine_id


async def test_retry_after_rests_the_target_that_asked_for_it(
    steady: str, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    busy = {"on": True, "hits": 0}

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        busy["hits"] += 1
        if busy["on"]:
            return web.json_response({"error": "busy"}, status=429, headers={"Retry-After": "1"})
        return web.json_response({"choices": [{"text": "ok"}]}, headers={"X-From": "busy"})

    app = completions_engine(complete)
    async with serving(app) as url:
        router = await start_router(
            RouterConfig(workers=workers(url, steady, dialect="vllm", dp_size=1))
        )

        def pool() -> list[str]:
            return [t.label for t in router.registry.snapshot.pool()]

        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200 and r.headers["X-From"] == "steady"
        assert pool() == ["w1"] and busy["hits"] == 1  # resting, as it asked
        busy["on"] = False
        for _ in range(3):
            async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
                assert r.headers["X-From"] == "steady"
        assert busy["hits"] == 1
        assert await until(lambda: pool() == ["w0", "w1"], 3)  # back after its second


async def test_attempts_are_spaced_by_a_growing_backoff(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(faults=Faults(fail_rate=1.0))] * 3)
    config = RouterConfig(workers=workers(*cluster.urls), retry_backoff=0.2, breaker_failures=0)
    router = await start_router(config)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 500  # the last engine's own answer
    assert loop.time() - t0 >= 0.5 * 0.2 + 0.5 * 0.4  # two waits, each at least half its step
    assert sum(s.generation_requests for s in cluster.servers) == 3


async def test_a_slow_health_check_fails_and_recovery_takes_several_good_ones(
    flaky: Flaky, steady: str, start_router: StartRouter
) -> None:
    flaky.broken = False
    specs = workers(flaky.url, steady, dialect="vllm", dp_size=1)
    config = RouterConfig(
        workers=specs,
        health_interval=0.05,
        health_failures=2,
        health_timeout=0.2,
        health_successes=3,
    )
    router = await start_router(config)
    w0 = router.registry.workers["w0"]
    flaky.slow_health = 1.0  # answers 200, but too late
    assert await until(lambda: not w0.ready, 5)
    flaky.slow_health = 0.0
    before = flaky.checks
    assert await until(lambda: w0.ready, 5)
    assert flaky.checks - before >= 3  # three good checks in a row before it came back


async def test_an_engine_cutting_its_streams_short_is_taken_out(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    engine = CutsStreams(b'data: {"choices": [{"text": "a"}]}\n\n')
    app = completions_engine(engine.answer)
    (good,) = (await start_cluster([EngineConfig()])).servers
    async with serving(app) as cutting:
        specs = (*workers(cutting, dialect="vllm", dp_size=1), *workers(good.url))
        router = await start_router(
            RouterConfig(workers=specs, breaker_failures=2, breaker_cooldown=60)
        )
        ends = await stream_ends(http, router.url, PROMPT, 12)
    assert engine.cuts == 2 and ends == {"cut": 2, "whole": 10}  # two cuts opened the breaker
    assert [t.label for t in router.registry.snapshot.pool()] == ["w1"]
