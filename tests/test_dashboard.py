"""``/dashboard/data`` against a simulated 2 × DP8 + 1 × DP4 cluster; off without
``--dashboard``; behind the admin token when one is set; under ``--processes``. And the
live view for RL, over simulated SGLang engines: the requests held in the router by
class, each worker's hold and weights' version, in the data and in ``/metrics``."""

from __future__ import annotations

import asyncio
import base64
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import click
import pytest

from dprouter.cli.demo import demo_cluster
from dprouter.cli.serve import serve
from dprouter.config import RouterConfig, load_file, validate
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.multiproc.supervisor import Supervisor
from dprouter.server.dashboard import POLICY
from dprouter.server.dashboard.window import quantile
from dprouter.sim.model.config import EngineConfig, PdConfig, RankLimits
from tests.conftest import (
    StartCluster,
    StartProcesses,
    StartRouter,
    background,
    metric_sum,
    until,
    workers,
)
from tests.test_door import tenants_file
from tests.test_router_pd import deploy, served

BODY: dict[str, Any] = {"model": "demo", "prompt": "look at me", "max_tokens": 4}


async def get_data(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    async with http.get(url + "/dashboard/data", headers=headers) as r:
        assert r.status == 200, await r.text()
        found: dict[str, Any] = await r.json()
        return found


async def test_without_the_flag_there_is_no_dashboard(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster(demo_cluster()[:1])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    for path in ("/dashboard", "/dashboard/data", "/dashboard/dashboard.js"):
        async with http.get(router.url + path) as r:
            assert r.status == 404, path


async def test_data_shows_every_target_with_its_load_and_rates(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster(demo_cluster())
    config = RouterConfig(workers=workers(*cluster.urls), dashboard=True)
    router = await start_router(config)
    for _ in range(40):
        async with http.post(router.url + "/v1/completions", json=BODY) as r:
            assert r.status == 200
            await r.read()

    def counted(data: dict[str, Any]) -> int:
        return round(float(data["router"]["requests_per_second"]) * float(data["window_seconds"]))

    data = await get_data(http, router.url)
    for _ in range(50):  # the window reads the series once a second: until a read after all
        if counted(data) == 40:
            break
        await asyncio.sleep(0.1)
        data = await get_data(http, router.url)
    assert counted(data) == 40
    targets = data["targets"]
    assert len(targets) == 20
    assert {t["worker"] for t in targets} == {w.id for w in router.registry.workers.values()}
    last = list(router.registry.workers)[-1]
    assert sorted(t["dp_rank"] for t in targets if t["worker"] == last) == [0, 1, 2, 3]
    first = targets[0]
    assert first.keys() >= {"target", "role", "in_flight", "engine_load", "ready", "breaker"}
    assert all(t["ready"] and t["breaker"] == "closed" and t["in_flight"] == 0 for t in targets)
    # round robin: each of the 20 targets answered 2 of the 40, each with a first byte
    answered = [t for t in targets if t["requests_per_second"] > 0]
    assert len(answered) == 20
    assert all(t["ttfb_p50_seconds"] is not None and t["errors"] == {} for t in answered)
    info = data["router"]
    assert info["processes"] == 1 and info["policy"] == "round_robin"
    assert info["discovery"] == {
        "source": "static",
        "stale": False,
        "workers": {"ready": 3, "discovering": 0, "error": 0},
    }
    assert info["in_flight"] == 0 and info["event_loop_lag_seconds"] >= 0
    assert info["version"] and info["uptime_seconds"] >= 0
    assert data["lanes"] is None and data["pairs"] == []
    assert [w["dp_size"] for w in data["workers"]] == [8, 8, 4]


async def test_each_target_shows_the_streams_in_flight_on_its_own_rank(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Streams held on chosen ranks (a trusted client pins them): each target's row counts
    the streams of its own rank, as the engine counts them, not a neighbour's."""
    (engine,) = (await start_cluster([demo_cluster()[2]])).servers  # one engine, DP4
    config = RouterConfig(workers=workers(engine.url), dashboard=True, trust_client_rank=True)
    router = await start_router(config)
    held = {0: 1, 1: 3, 2: 0, 3: 2}
    long = {**BODY, "max_tokens": 5000, "stream": True}
    streams = []
    try:
        for rank, count in held.items():
            for _ in range(count):
                r = await http.post(
                    router.url + "/v1/completions", json={**long, "routed_dp_rank": rank}
                )
                assert r.status == 200
                await r.content.readuntil(b"\n\n")  # under way
                streams.append(r)
        rows = {t["dp_rank"]: t["in_flight"] for t in (await get_data(http, router.url))["targets"]}
        assert rows == held
        assert {i: r.num_running for i, r in enumerate(engine.engine.ranks)} == held
        assert (await get_data(http, router.url))["router"]["in_flight"] == sum(held.values())
    finally:
        for r in streams:
            r.close()


async def test_the_page_and_its_files_are_served_with_a_strict_policy(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster(demo_cluster()[:1])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), dashboard=True))
    for path, kind in (
        ("/dashboard", "text/html"),
        ("/dashboard/dashboard.js", "text/javascript"),
        ("/dashboard/dashboard.css", "text/css"),
    ):
        async with http.get(router.url + path) as r:
            assert r.status == 200 and r.content_type == kind
            assert r.headers["Content-Security-Policy"] == POLICY
            assert b"http://" not in await r.read() or kind == "text/javascript"
    assert "default-src 'none'" in POLICY and "unsafe" not in POLICY
    async with http.get(router.url + "/dashboard/other.js") as r:
        assert r.status == 404


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/data", "/dashboard/dashboard.js"])
async def test_with_an_admin_token_the_dashboard_needs_it(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession, path: str
) -> None:
    cluster = await start_cluster(demo_cluster()[:1])
    config = RouterConfig(workers=workers(*cluster.urls), dashboard=True, admin_token="s3cret")
    router = await start_router(config)
    basic = base64.b64encode(b"anyone:s3cret").decode()
    wrong = base64.b64encode(b"anyone:guess").decode()
    for headers, status in (
        ({}, 401),
        ({"Authorization": "Bearer guess"}, 401),
        ({"Authorization": f"Basic {wrong}"}, 401),
        ({"Authorization": "Basic !!"}, 401),
        ({"Authorization": "Bearer s3cret"}, 200),
        ({"Authorization": f"Basic {basic}"}, 200),
    ):
        async with http.get(router.url + path, headers=headers) as r:
            assert r.status == status, headers
            if status == 401:  # a browser asks for the token
                assert r.headers["WWW-Authenticate"].startswith("Basic")


async def test_under_two_processes_the_data_is_the_whole_routers(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster(demo_cluster()[:1])
    config = RouterConfig(workers=workers(*cluster.urls), dashboard=True, sessions=True)
    sup = Supervisor(replace(config, port=0, processes=2, grace=2.0))
    await sup.start()
    try:
        assert await sup.settled(10)
        for n in range(24):  # a connection each, so both processes serve some
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                s.post(sup.url + "/v1/completions", json={**BODY, "user": f"key-{n}"}) as r,
            ):
                assert r.status == 200
        total = 0.0
        for _ in range(40):
            data = await get_data(http, sup.url)
            total = sum(t["requests_per_second"] for t in data["targets"])
            if data["window_seconds"] and round(total * data["window_seconds"]) == 24:
                break
            await asyncio.sleep(0.1)
        assert round(total * data["window_seconds"]) == 24  # both processes' requests
        assert data["router"]["processes"] == 2
        assert data["router"]["sessions"] == 24  # the parent's table
        assert len(data["targets"]) == 8
    finally:
        await sup.stop()


def test_quantiles_follow_prometheus_interpolation() -> None:
    buckets = {0.01: 0.0, 0.1: 10.0, 1.0: 20.0, float("inf"): 20.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.25, buckets) == pytest.approx(0.055)
    assert quantile(0.99, {0.5: 0.0, float("inf"): 3.0}) == 0.5
    assert quantile(0.5, {0.5: 0.0, float("inf"): 0.0}) is None


def test_the_file_turns_it_on_as_the_flag_does(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text('dashboard = true\n[[workers]]\nurl = "http://127.0.0.1:8000"\n')
    assert validate(RouterConfig(**load_file(path))).dashboard
    assert "--dashboard" in [o.opts[0] for o in serve.params if isinstance(o, click.Option)]


async def test_pd_lanes_and_pairs(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    deployed = await deploy(start_cluster, start_router, "sglang", (1, 2), (1, 2), dashboard=True)
    url = deployed.router.url
    pairs = await served(http, url, 8)
    data = await get_data(http, url)
    for _ in range(40):
        if sum(p["requests"] for p in data["pairs"]) == 8:
            break
        await asyncio.sleep(0.1)
        data = await get_data(http, url)
    assert data["router"]["pd"] == "sglang"
    assert len(data["lanes"]["prefill"]) == 2 and len(data["lanes"]["decode"]) == 2
    seen = {(p["prefill"], p["decode"]): p["requests"] for p in data["pairs"]}
    assert seen == dict(Counter(pairs))


# -- the live view for RL ---------------------------------------------------------------
# SGLang engines of 2 ranks x 2 running slots, reporting their caps: the router holds what
# they cannot run. A step ~6 ms: a stream of 5,000 tokens runs for half a minute.
SGLANG = EngineConfig(
    persona="sglang",
    dp_size=2,
    dp_attention=True,
    limits=RankLimits(max_running=2),
    time_scale=1.0,
)
RUN: dict[str, Any] = {"prompt": "a long rollout", "max_tokens": 5000, "stream": True}
HELD = {"low": 3, "high": 2}  # requests held mid-step, by class


async def post(url: str, body: dict[str, Any], headers: dict[str, str], opened: list[int]) -> None:
    """One request on a connection of its own (under --processes either process takes it),
    read to its end, or until cancelled."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + "/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        await r.content.readline()
        opened.append(1)
        async for _ in r.content:
            pass


async def command(http: aiohttp.ClientSession, url: str, path: str, body: Any = None) -> None:
    async with http.post(url + path, json=body or {}) as r:
        assert r.status == 200, await r.text()


class Step:
    """The requests a step holds in the router, by class; each on a connection of its own."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url
        self.held: Counter[str] = Counter()
        self.tasks: list[asyncio.Task[None]] = []

    async def hold(self, name: str, count: int = 1) -> None:
        """``count`` more requests of class ``name``, held in the router (its gauge says)."""
        for _ in range(count):
            body = {"prompt": f"{name} {self.held[name]}", "max_tokens": 8}
            self.held[name] += 1
            sent = post(self.url, body, {"X-Priority": name}, [])
            self.tasks.append(asyncio.create_task(sent))
        assert await held_in(self.http, self.url, self.held.total())


@asynccontextmanager
async def mid_step(http: aiohttp.ClientSession, url: str, slots: int = 4) -> AsyncIterator[Step]:
    """A router at ``url`` over two SGLang engines (w0, w1) as an RL step leaves it: w1
    paused and w0 at weights 7 (both through the router), w0's ``slots`` running slots
    taken by long streams, and ``HELD`` more requests held in the router, by class."""
    await command(http, url, "/pause_generation?worker=w1", {"mode": "in_place"})
    await command(http, url, "/update_weight_version?worker=w0", {"new_version": "7"})
    running: list[int] = []
    runners = [post(url, RUN, {"X-Priority": "normal"}, running) for _ in range(slots)]
    async with background(*runners):
        assert await until(lambda: len(running) == slots), "w0's slots were never all taken"
        step = Step(http, url)
        try:
            for name, count in HELD.items():
                await step.hold(name, count)
            yield step
        finally:
            for task in step.tasks:
                task.cancel()
            await asyncio.gather(*step.tasks, return_exceptions=True)


async def held_in(http: aiohttp.ClientSession, url: str, n: int) -> bool:
    """Whether the router at ``url`` comes to hold ``n`` requests (its gauge), within 5 s."""
    for _ in range(250):
        if await metric_sum(http, url, "dprouter_held_requests") == n:
            return True
        await asyncio.sleep(0.02)
    return False


def rl_config(tmp_path: Path, *urls: str) -> RouterConfig:
    """A router whose clients may name their class (``X-Priority``), with the dashboard."""
    tenants = tenants_file(tmp_path, {"set_class": True})
    return RouterConfig(workers=workers(*urls), dashboard=True, tenants=tenants)


def view(data: dict[str, Any]) -> tuple[dict[str, int], dict[str, tuple[str | None, str]]]:
    """What the data says mid-step: requests held by class, and each worker's hold and
    version."""
    held = data["router"]["held_requests"]
    by_class = {name: sum(n.values()) for name, n in held["classes"].items()}
    assert held["total"] == sum(by_class.values())
    return by_class, {w["id"]: (w["hold"], w["weight_version"]) for w in data["workers"]}


async def test_mid_step_the_data_and_metrics_show_held_requests_holds_and_versions(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    cluster = await start_cluster([SGLANG, SGLANG])
    router = await start_router(rl_config(tmp_path, *cluster.urls))
    assert await until(lambda: all(t.board.cap_of(t.slot) for t in router.registry.targets()))
    async with mid_step(http, router.url):
        data = await get_data(http, router.url)
        by_class, workers_seen = view(data)
        assert by_class == {"high": 2, "normal": 0, "low": 3}
        assert data["router"]["held_requests"]["classes"]["low"] == {"slot": 3, "worker": 0}
        assert workers_seen == {"w0": (None, "7"), "w1": ("paused", "default")}
        w1 = next(w for w in data["workers"] if w["id"] == "w1")
        assert w1["held"] == "paused" and w1["state"] == "ready"
        url = router.url
        for name, count in HELD.items():
            assert await metric_sum(http, url, "dprouter_held_requests", **{"class": name}) == count
        assert await metric_sum(http, url, "dprouter_held_requests", why="worker") == 0
        assert await metric_sum(http, url, "dprouter_worker_held", worker="w1") == 1
        assert await metric_sum(http, url, "dprouter_worker_held", state="paused") == 1
        assert await metric_sum(http, url, "dprouter_worker_held", worker="w0") == 0
        version = "dprouter_worker_weight_version_info"
        assert await metric_sum(http, url, version, worker="w0", version="7") == 1
        assert await metric_sum(http, url, version, worker="w1", version="default") == 1
    assert await held_in(http, router.url, 0)  # the held clients left: none counts on
    assert view(await get_data(http, router.url))[0] == {"high": 0, "normal": 0, "low": 0}


async def test_a_request_waiting_for_a_held_worker_is_held_too(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Every worker paused: a request waits in the router for the resume (``--hold-wait``),
    counted as held for a worker, and is served once the workers continue."""
    cluster = await start_cluster([SGLANG])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), dashboard=True))
    await command(http, router.url, "/pause_generation", {"mode": "in_place"})
    opened: list[int] = []
    body = {"prompt": "after the update", "max_tokens": 4, "stream": True}
    waiting = asyncio.create_task(post(router.url, body, {}, opened))
    assert await held_in(http, router.url, 1)
    held = (await get_data(http, router.url))["router"]["held_requests"]
    assert held["classes"]["high"] == {"slot": 0, "worker": 1}  # no tenants: the first class
    assert not opened
    await command(http, router.url, "/continue_generation")
    await waiting
    assert opened == [1] and await held_in(http, router.url, 0)


async def test_pd_requests_held_for_a_decode_slot_count(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """SGLang P/D, a decode of 4 running slots: 4 long requests run, 2 more are held on the
    decode pool, and the data counts them."""
    prefill = EngineConfig(persona="sglang", pd=PdConfig("sglang", "prefill"))
    decode = replace(SGLANG, dp_attention=False, pd=PdConfig("sglang", "decode"))
    p, d = (await start_cluster([prefill, decode])).servers
    specs = (WorkerSpec(p.url, role="prefill"), WorkerSpec(d.url, role="decode"))
    router = await start_router(RouterConfig(pd="sglang", workers=specs, dashboard=True))
    running: list[int] = []
    async with background(*(post(router.url, RUN, {}, running) for _ in range(4))):
        assert await until(lambda: len(running) == 4)
        short = {"prompt": "short", "max_tokens": 4}
        async with background(*(post(router.url, short, {}, []) for _ in range(2))):
            assert await held_in(http, router.url, 2)
            held = (await get_data(http, router.url))["router"]["held_requests"]
            assert held["total"] == 2 and held["classes"]["high"] == {"slot": 2, "worker": 0}
            assert len(d.received) == 4  # held in the router, not on the decode engine


async def test_under_two_processes_the_step_is_the_whole_routers(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_processes: StartProcesses,
    http: aiohttp.ClientSession,
) -> None:
    """The same step under --processes 2, each request on a connection of its own: the
    held requests are summed over both processes, the holds and versions the parent's."""
    cluster = await start_cluster([SGLANG, SGLANG])
    sup = await start_processes(rl_config(tmp_path, *cluster.urls))
    slots = [t.slot for t in sup.registry.targets()]
    assert await until(lambda: all(sup.board.cap[slots]))
    async with mid_step(http, sup.url) as step:
        # the kernel spreads the connections over the two processes: until both hold some
        while not (sup.board.looked != 0).all() and step.held.total() < 25:
            await step.hold("low")
        assert (sup.board.looked != 0).all(), "every held request went to one process"
        expected = {"high": 2, "normal": 0, "low": step.held["low"]}
        for _ in range(4):  # whichever process answers, it answers for the whole router
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)
            ) as fresh:
                by_class, workers_seen = view(await get_data(fresh, sup.url))
            assert by_class == expected
            assert workers_seen == {"w0": (None, "7"), "w1": ("paused", "default")}
        assert await metric_sum(http, sup.url, "dprouter_worker_held", state="paused") == 1
