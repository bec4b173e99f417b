"""``/dashboard/data`` against a simulated 2 × DP8 + 1 × DP4 cluster; off without
``--dashboard``; behind the admin token when one is set; under ``--processes``."""

from __future__ import annotations

import asyncio
import base64
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import click
import pytest

from dprouter.cli.demo import demo_cluster
from dprouter.cli.serve import serve
from dprouter.config import RouterConfig, load_file, validate
from dprouter.multiproc.supervisor import Supervisor
from dprouter.server.dashboard import POLICY
from dprouter.server.dashboard.window import quantile
from tests.conftest import StartCluster, StartRouter, workers
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
