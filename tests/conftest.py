"""Shared fixtures: simulated engines started in-process on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from dprouter.config import RouterConfig
from dprouter.core.net import bind, url_of
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.multiproc.supervisor import Supervisor
from dprouter.server.router import Router
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.vocab import write_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer files the simulated engines and the router both read (written once)."""
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


class StartCluster(Protocol):
    async def __call__(
        self, configs: Sequence[EngineConfig], host: str = "127.0.0.1"
    ) -> SimCluster: ...


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
async def start_cluster() -> AsyncIterator[StartCluster]:
    started: list[SimCluster] = []

    async def start(configs: Sequence[EngineConfig], host: str = "127.0.0.1") -> SimCluster:
        cluster = SimCluster(configs, host)
        await cluster.start()
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        await cluster.stop()


@asynccontextmanager
async def background(*coros: Coroutine[Any, Any, Any]) -> AsyncIterator[None]:
    """Run requests in the background for the block; cancel what is left at its end."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class StartRouter(Protocol):
    async def __call__(self, config: RouterConfig, settle: bool = True) -> Router: ...


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    started: list[Router] = []

    async def start(config: RouterConfig, settle: bool = True) -> Router:
        # a short grace: a test that leaves a request hanging should not wait 30 s at the end
        router = Router(replace(config, port=0, grace=min(config.grace, 2.0)))
        await router.start()
        started.append(router)
        if settle:
            assert await router.settled(10), "discovery did not settle"
        return router

    yield start
    for router in started:
        await router.stop()


def workers(*urls: str, **keys: object) -> tuple[WorkerSpec, ...]:
    return tuple(WorkerSpec(url, **keys) for url in urls)  # type: ignore[arg-type]


Answer = Callable[[web.Request], Coroutine[Any, Any, web.StreamResponse]]


def completions_engine(handler: Answer) -> web.Application:
    """A stand-in engine: ``handler`` answers ``POST /v1/completions``."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    return app


class CutsStreams:
    """A stand-in engine that answers 200, sends ``first``, then dies mid-stream."""

    def __init__(self, first: bytes) -> None:
        self.first = first
        self.cuts = 0

    async def answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # 200 and a first event: too late to retry elsewhere
        await resp.write(self.first)
        self.cuts += 1
        assert request.transport is not None
        request.transport.abort()
        return resp


async def healthy(_: web.Request) -> web.Response:
    return web.Response(status=200)


def answers_health(app: web.Application) -> web.Application:
    """Like every real engine, a stand-in answers ``GET /health`` (unless it has its own)."""
    if not any(r.resource and r.resource.canonical == "/health" for r in app.router.routes()):
        app.router.add_get("/health", healthy)
    return app


@asynccontextmanager
async def serving(app: web.Application, health: bool = True) -> AsyncIterator[str]:
    """Serve a small stand-in upstream on a free loopback port; yields its URL (``health``:
    it answers ``GET /health``, as engines do)."""
    if health:
        answers_health(app)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = bind("127.0.0.1", 0)
    await web.SockSite(runner, sock).start()
    try:
        yield url_of("127.0.0.1", sock.getsockname()[1])
    finally:
        await runner.cleanup()


async def stream_ends(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], n: int
) -> Counter[str]:
    """``n`` streamed requests to ``url``, each answered 200: how many streams ended whole
    and how many the router had to end with its error event ("cut")."""
    ends: Counter[str] = Counter()
    for _ in range(n):
        async with http.post(url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status == 200
            ends["cut" if b"closed the stream" in await r.read() else "whole"] += 1
    return ends


class Stalling:
    """A stand-in engine on an event loop of its own thread, behind a two-place accept queue.
    ``stall`` blocks that loop with the queue full: connections to it then do not open
    (SYNs are dropped) until the loop runs again -- an engine that stops accepting."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop, port: int) -> None:
        self.url, self.loop, self.port = url, loop, port
        self.fillers: list[socket.socket] = []

    async def stall(self, seconds: float) -> None:
        self.loop.call_soon_threadsafe(time.sleep, seconds)
        await asyncio.sleep(0.05)  # it sleeps now; these two wait in its queue, unaccepted
        self.fillers += [socket.create_connection(("127.0.0.1", self.port)) for _ in range(2)]


@asynccontextmanager
async def stalling(app: web.Application) -> AsyncIterator[Stalling]:
    sock = bind("127.0.0.1", 0, backlog=1)
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app)

    def on_loop(coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, loop).result(5)

    async def serve() -> None:
        await runner.setup()
        await web.SockSite(runner, sock, backlog=1).start()  # it listens anew: keep it small

    answers_health(app)
    on_loop(serve())
    engine = Stalling(url_of("127.0.0.1", port), loop, port)
    try:
        yield engine
    finally:
        for filler in engine.fillers:
            filler.close()
        on_loop(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def reserve_port() -> socket.socket:
    """A loopback port held, not listening: connections to it are refused, no other process
    takes it, and a server binding it with SO_REUSEADDR (as ours do) gets it. Close it once
    that server is up."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    return holder


async def until(check: Callable[[], bool], seconds: float = 5.0) -> bool:
    """Poll ``check`` until it holds, for at most ``seconds``."""
    for _ in range(int(seconds / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


async def metric_sum(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """The samples named ``name`` on ``url``/metrics whose labels include ``labels``, summed."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


async def metric_by(
    http: aiohttp.ClientSession, url: str, name: str, label: str
) -> dict[str, float]:
    """The samples named ``name`` on ``url``/metrics, summed per value of ``label`` (an
    engine's DP rank: SGLang's ``dp_rank``, vLLM's ``engine``)."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


StartProcesses = Callable[[RouterConfig], Coroutine[Any, Any, Supervisor]]


@pytest.fixture
async def start_processes() -> AsyncIterator[StartProcesses]:
    started: list[Supervisor] = []

    async def start(config: RouterConfig) -> Supervisor:
        sup = Supervisor(replace(config, port=0, processes=2, grace=min(config.grace, 5.0)))
        started.append(sup)
        await sup.start()
        assert await sup.settled(10), "discovery did not settle"
        return sup

    yield start
    for sup in started:
        if not sup.stopping:
            await sup.stop()
