"""One set of attempt rules, plain and P/D alike: every fault through every path, and a
dead engine never taking a request down while another engine is healthy."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.net import bind, url_of
from dprouter.core.types import PdMode, Role
from dprouter.fleet.targets import Worker
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.server.router import Router
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, PdConfig
from tests.conftest import StartCluster, StartRouter, until

PROMPT = {"prompt": "try me", "max_tokens": 2}
# where the fault is: a plain worker, the prefill side of a pair, or its decode side
PATHS = ["plain", "pd-prefill", "pd-decode"]


@dataclass
class Scripted:
    """A stand-in vLLM engine: every completion gets ``status`` (with ``retry_after``);
    a P/D prefill's success carries kv_transfer_params. ``stop`` closes its port."""

    status: int = 200
    retry_after: str | None = None
    prefill: bool = False
    hits: int = 0
    url: str = ""
    runner: web.AppRunner | None = field(default=None, repr=False)

    async def completions(self, request: web.Request) -> web.Response:
        await request.read()
        self.hits += 1
        if self.status != 200:
            body = {"error": {"message": f"engine says {self.status}", "code": self.status}}
            headers = {"Retry-After": self.retry_after} if self.retry_after else {}
            return web.json_response(body, status=self.status, headers=headers)
        answer: dict[str, Any] = {"choices": [{"index": 0, "text": "ok"}]}
        if self.prefill:
            answer["kv_transfer_params"] = {"remote_engine_id": "e", "remote_block_ids": [1]}
        return web.json_response(answer)

    async def start(self) -> str:
        async def ok(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": []})

        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", ok)
        app.router.add_get("/v1/models", ok)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        sock = bind("127.0.0.1", 0)
        await web.SockSite(self.runner, sock).start()
        self.url = url_of("127.0.0.1", sock.getsockname()[1])
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@asynccontextmanager
async def fleet(
    start_router: StartRouter, path: str, faulty: Scripted, with_good: bool
) -> AsyncIterator[tuple[Router, Scripted, Worker]]:
    """A router over ``faulty`` (and a good sibling of its role if asked); P/D paths add
    a good engine of the other role. Yields the router, the good sibling, the faulty worker."""
    roles: dict[str, Role] = {"plain": "regular", "pd-prefill": "prefill", "pd-decode": "decode"}
    role = roles[path]
    good = Scripted(prefill=role == "prefill")
    faulty.prefill = role == "prefill"
    engines: list[tuple[Scripted, Role]] = [(faulty, role)]
    if with_good:
        engines.append((good, role))
    if role != "regular":
        other: Role = "decode" if role == "prefill" else "prefill"
        engines.append((Scripted(prefill=other == "prefill"), other))
    async with AsyncExitStack() as stack:
        specs = []
        for engine, r in engines:
            stack.push_async_callback(engine.stop)
            specs.append(WorkerSpec(await engine.start(), role=r, dialect="vllm", dp_size=1))
        pd: PdMode | None = None if role == "regular" else "vllm-nixl"
        router = await start_router(RouterConfig(workers=tuple(specs), pd=pd, retry_backoff=0))
        (worker,) = [w for w in router.registry.workers.values() if w.url == faulty.url]
        yield router, good, worker


async def post(http: aiohttp.ClientSession, router: Router) -> tuple[int, dict[str, str], Any]:
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        return r.status, dict(r.headers), await r.json()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("status", "retry_after"), [(429, "7"), (503, "2"), (500, None)])
async def test_the_last_chance_passes_the_engines_own_answer_through(
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    path: str,
    status: int,
    retry_after: str | None,
) -> None:
    """A lone engine's 429 or 503 reaches the client with its Retry-After, its 500 as it is."""
    faulty = Scripted(status, retry_after)
    async with fleet(start_router, path, faulty, with_good=False) as (router, _, worker):
        got, headers, body = await post(http, router)
        assert (got, headers.get("Retry-After")) == (status, retry_after)
        assert body["error"]["message"] == f"engine says {status}"
        # 5xx counts against the rank's breaker (the last of its role never opens); busy not
        assert router.parts.breakers.failures(worker.targets[0]) == (1 if status >= 500 else 0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("status", [429, 503])
async def test_retry_after_rests_the_target_and_the_request_goes_elsewhere(
    start_router: StartRouter, http: aiohttp.ClientSession, path: str, status: int
) -> None:
    faulty = Scripted(status, "30")
    async with fleet(start_router, path, faulty, with_good=True) as (router, good, worker):
        results = [(await post(http, router))[0] for _ in range(6)]
        assert worker.targets[0].tripped  # resting for the 30 s it asked for
        failures = router.parts.breakers.failures(worker.targets[0])
    assert results == [200] * 6
    assert (faulty.hits, good.hits) == (1, 6)
    assert failures == (1 if status == 503 else 0)  # busy is not broken


@pytest.mark.parametrize("path", PATHS)
async def test_a_refused_connection_takes_the_worker_out_without_a_breaker_count(
    start_router: StartRouter, http: aiohttp.ClientSession, path: str
) -> None:
    faulty = Scripted()
    async with fleet(start_router, path, faulty, with_good=True) as (router, good, worker):
        await faulty.stop()
        results = [(await post(http, router))[0] for _ in range(4)]
        assert results == [200] * 4 and good.hits == 4
        assert worker.state == "discovering"  # out of the snapshot until it answers again
        assert router.parts.breakers.failures(worker.targets[0]) == 0
        # and the log says what happened to it
        assert await until(lambda: worker.error == "DiscoveryError: connection refused")


@pytest.mark.parametrize("path", PATHS)
async def test_when_every_connection_is_refused_the_client_hears_503(
    start_router: StartRouter, http: aiohttp.ClientSession, path: str
) -> None:
    faulty = Scripted()
    async with fleet(start_router, path, faulty, with_good=False) as (router, _, _):
        await faulty.stop()
        status, _, body = await post(http, router)
    assert status == 503
    assert body["error"]["type"] == "service_unavailable_error"
    assert "no worker could be reached (1 tried)" in body["error"]["message"]


# -- a dead engine: every rank of it leaves the request's remaining attempts ---------------


async def load_through_a_crash(
    http: aiohttp.ClientSession, router: Router, dead: SimServer, n: int = 48
) -> Counter[int]:
    """``n`` non-streamed requests, started 15 ms apart; the engine ``dead`` is killed
    when a third of them are under way. What status did each client get?"""

    async def one() -> int:
        body = {**PROMPT, "max_tokens": 40}
        async with http.post(router.url + "/v1/completions", json=body) as r:
            await r.read()
            return r.status

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one()))
        if i == n // 3:
            await dead.crash()
        await asyncio.sleep(0.015)
    return Counter(await asyncio.gather(*tasks))


@pytest.mark.parametrize("policy", ["least_load", "min_tokens", "round_robin"])
async def test_a_killed_engine_loses_no_request_while_another_is_healthy(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    policy: str,
) -> None:
    live, dead = (await start_cluster([EngineConfig(dp_size=4), EngineConfig(dp_size=4)])).servers
    config = RouterConfig(
        workers=(WorkerSpec(live.url), WorkerSpec(dead.url)), policy=policy, retry_backoff=0
    )
    router = await start_router(config)
    outcomes = await load_through_a_crash(http, router, dead)
    assert outcomes == {200: 48}
    assert len({rec.rank for rec in dead.received}) == 4  # it did take its share first
    assert all(t.outstanding == 0 for t in router.registry.targets())


@pytest.mark.parametrize(("mode", "side"), [("vllm-nixl", "decode"), ("sglang", "prefill")])
async def test_a_killed_pd_engine_loses_no_request_while_another_is_healthy(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    mode: PdMode,
    side: str,
) -> None:
    def engine(role: Role) -> EngineConfig:
        assert role != "regular"
        pd = PdConfig(mode=mode, role=role, kv_wait=2.0)
        return EngineConfig(persona=pd.persona, dp_size=4, pd=pd)

    roles: list[Role] = ["prefill", "prefill", "decode", "decode"]
    cluster = await start_cluster([engine(r) for r in roles])
    specs = [WorkerSpec(s.url, role=r) for s, r in zip(cluster.servers, roles, strict=True)]
    router = await start_router(
        RouterConfig(workers=tuple(specs), pd=mode, policy="least_load", retry_backoff=0)
    )
    dead = cluster.servers[1 if side == "prefill" else 3]
    outcomes = await load_through_a_crash(http, router, dead)
    assert outcomes == {200: 48}
    assert all(t.outstanding == 0 for t in router.registry.targets())
