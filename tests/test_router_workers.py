"""Discovery and the admin API: workers come, go, and are never routed half-known."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig, validate
from dprouter.core.errors import ConfigError
from dprouter.core.net import url_of
from dprouter.fleet import engine_load, probe
from dprouter.fleet.targets import Worker
from dprouter.server.trust import Trust
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, PdConfig
from tests.conftest import (
    StartCluster,
    StartRouter,
    background,
    reserve_port,
    serving,
    until,
    workers,
)

TOKEN = "s3cret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = {"prompt": "who serves me", "max_tokens": 2}


async def test_vllm_ranks_come_from_metrics_and_a_contradiction_is_refused(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    right, wrong = (await start_cluster([EngineConfig(dp_size=2), EngineConfig(dp_size=2)])).servers
    config = RouterConfig(
        workers=(*workers(right.url), *workers(wrong.url, dp_size=4)), admin_token=TOKEN
    )
    router = await start_router(config)
    good, bad = router.registry.workers.values()
    assert (good.state, good.dialect, good.ranks) == ("ready", "vllm", 2)
    assert bad.state == "error" and "configured with dp_size 4" in (bad.error or "")
    assert [t.label for t in router.registry.snapshot.pool()] == ["w0/0", "w0/1"]
    async with http.get(router.url + "/workers", headers=ADMIN) as r:
        listed = (await r.json())["workers"]
    assert [(w["id"], w["state"], len(w["targets"])) for w in listed] == [
        ("w0", "ready", 2),
        ("w1", "error", 0),
    ]


@pytest.mark.parametrize(
    ("info", "ranks", "lock_step"),
    [
        ({"dp_size": 1}, 1, False),  # one rank
        ({"dp_size": 4, "enable_dp_attention": False}, 4, False),  # older SGLang, DP
        ({"dp_size": 4, "enable_dp_attention": True}, 4, True),  # older SGLang, attention DP
        ({"dp_size": 2, "attn_dp_size": 1, "enable_dp_attention": False}, 2, False),  # 0.5.23
        ({"dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True}, 2, True),  # 0.5.23
        ({"dp_size": 1, "attn_dp_size": 8}, 8, True),  # once enable_dp_attention is gone
    ],
)
def test_sglang_ranks_from_either_server_info_shape(
    info: dict[str, object], ranks: int, lock_step: bool
) -> None:
    assert probe.sglang_ranks("http://e", info) == (ranks, lock_step)


@pytest.mark.parametrize(
    ("info", "seen"),
    [
        ({"dp_size": 2, "attn_dp_size": 4}, "dp_size=2, attn_dp_size=4"),
        ({"dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": False}, "attn_dp_size=2"),
        ({"dp_size": "2"}, "dp_size='2'"),
        ({"dp_size": 0}, "dp_size=0"),
        ({"dp_size": 1, "attn_dp_size": None}, "attn_dp_size=None"),
        ({"dp_size": 2, "enable_dp_attention": "yes"}, "enable_dp_attention='yes'"),
    ],
)
async def test_an_sglang_shape_dprouter_cannot_read_is_refused_with_its_fields(
    start_router: StartRouter, info: dict[str, object], seen: str
) -> None:
    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({**info, "tp_size": 2})

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    async with serving(app) as url:
        router = await start_router(RouterConfig(workers=workers(url)))
        (worker,) = router.registry.workers.values()
    assert worker.state == "error"
    assert f"{url}/server_info reports" in (worker.error or "") and seen in (worker.error or "")
    assert router.registry.snapshot.pool() == ()


async def test_a_worker_configured_as_the_other_kind_is_refused_not_retried(
    start_cluster: StartCluster, start_router: StartRouter
) -> None:
    vllm, sglang = (
        await start_cluster([EngineConfig(dp_size=2), EngineConfig(persona="sglang")])
    ).servers
    config = RouterConfig(
        workers=(*workers(vllm.url, dialect="sglang"), *workers(sglang.url, dialect="vllm"))
    )
    router = await start_router(config)
    errors = [w.error for w in router.registry.workers.values()]
    assert errors == [
        f"{vllm.url} is configured sglang but answers as vllm",
        f"{sglang.url} is configured vllm but answers as sglang",
    ]
    assert router.registry.snapshot.pool() == ()


@pytest.fixture
async def hybrid_metrics() -> AsyncIterator[str]:
    """A vLLM hybrid-LB endpoint's /metrics: it shows only its local engines 8..11."""
    text = "".join(
        f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {e - 8}.0\n'
        f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} 1.0\n'
        for e in range(8, 12)
    )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serving(app) as url:
        yield url


async def test_hybrid_lb_endpoint_takes_local_ranks(
    hybrid_metrics: str, http: aiohttp.ClientSession
) -> None:
    worker = Worker(id="node1", url=hybrid_metrics)
    found = await probe.probe(http, worker)
    assert (found.dialect, found.ranks, found.rank_offset) == ("vllm", 4, 8)
    probe.apply(worker, found)
    per_rank = await engine_load.scrape(http, worker)
    # engine 9 is local rank 1: 1 running + 1 waiting (no KV series here: 0 tokens)
    assert per_rank == {0: (1, 0), 1: (2, 0), 2: (3, 0), 3: (4, 0)}


async def test_a_late_worker_is_discovered_then_routed(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    holder = reserve_port()
    port = holder.getsockname()[1]
    router = await start_router(
        RouterConfig(workers=workers(url_of("127.0.0.1", port))), settle=False
    )
    (worker,) = router.registry.workers.values()
    assert await until(lambda: worker.error == "DiscoveryError: connection refused")
    assert worker.state == "discovering"
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 503  # never routed while unknown
    engine = SimServer(EngineConfig(persona="sglang", dp_size=2), port=port)
    await engine.start()
    holder.close()
    try:
        assert await router.settled(10)
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200 and r.headers["x-sim-dp-rank"] == "0"
    finally:
        await engine.stop()


async def test_admin_api_adds_lists_and_removes_workers_with_all_their_ranks(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    a, b = (
        await start_cluster([EngineConfig(dp_size=4), EngineConfig(persona="sglang", dp_size=2)])
    ).servers
    router = await start_router(RouterConfig(workers=workers(a.url), admin_token=TOKEN))
    async with http.post(router.url + "/workers", json={"url": b.url}) as r:
        assert r.status == 401
    async with http.post(
        router.url + "/workers?wait=5", json={"url": b.url, "id": "sg"}, headers=ADMIN
    ) as r:
        assert r.status == 201
        added = await r.json()
    assert (added["state"], added["dialect"], added["dp_size"]) == ("ready", "sglang", 2)
    assert [t["target"] for t in added["targets"]] == ["sg/0", "sg/1"]
    async with http.post(router.url + "/workers", json={"url": b.url}, headers=ADMIN) as r:
        assert r.status == 409
    async with http.post(router.url + "/workers", json={"url": "ftp://x"}, headers=ADMIN) as r:
        assert r.status == 400
    assert len(router.registry.snapshot.pool()) == 6
    async with http.delete(router.url + "/workers/w0", headers=ADMIN) as r:
        assert r.status == 200
    assert [t.label for t in router.registry.snapshot.pool()] == ["sg/0", "sg/1"]
    for _ in range(4):
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.headers["x-sim-engine"] == b.engine_id
    async with http.delete(router.url + "/workers/w0", headers=ADMIN) as r:
        assert r.status == 404


async def test_admin_api_checks_a_new_worker_against_the_running_router(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A --pd router takes prefill and decode workers from the admin API (they get traffic)
    and refuses a regular one, which would never get any; a duplicate is a conflict."""
    prefill, decode = (
        await start_cluster(
            [
                EngineConfig(dp_size=2, pd=PdConfig(mode="vllm-nixl", role="prefill")),
                EngineConfig(dp_size=2, pd=PdConfig(mode="vllm-nixl", role="decode")),
            ]
        )
    ).servers
    router = await start_router(RouterConfig(pd="vllm-nixl", admin_token=TOKEN))
    for url, role in ((prefill.url, "prefill"), (decode.url, "decode")):
        body = {"url": url, "role": role}
        async with http.post(router.url + "/workers?wait=5", json=body, headers=ADMIN) as r:
            assert r.status == 201, await r.text()
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200
        assert (r.headers["x-dprouter-prefill"], r.headers["x-dprouter-target"]) == ("p0/0", "d0/0")
    refusals = {
        "regular": ({"url": "http://127.0.0.1:9"}, 400, "every worker is --prefill or --decode"),
        "duplicate": ({"url": decode.url, "role": "decode"}, 409, "already registered"),
        "path": (
            {"url": "http://127.0.0.1:9/v1", "role": "decode"},
            400,
            "has a path (/v1): give the engine's root, http://127.0.0.1:9",
        ),
    }
    for body, status, message in refusals.values():
        async with http.post(router.url + "/workers", json=body, headers=ADMIN) as r:
            assert r.status == status
            assert message in (await r.json())["error"]["message"]
    assert len(router.registry.workers) == 2


def test_a_worker_url_with_a_path_is_refused_at_start_up() -> None:
    with pytest.raises(ConfigError, match=r"has a path \(/v1\): give the engine's root"):
        validate(RouterConfig(workers=workers("http://127.0.0.1:8000/v1")))


async def test_a_health_check_answered_404_is_a_failure(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """An engine with no /health where the router looks (a URL pointing below the engine's
    root, say) is never taken for a healthy one."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app, health=False) as url:
        router = await start_router(
            RouterConfig(workers=workers(url, dialect="vllm", dp_size=1)), settle=False
        )
        (worker,) = router.registry.workers.values()
        assert await until(lambda: worker.error is not None)
    assert worker.state == "discovering"
    assert "GET /health answered 404" in (worker.error or "")


async def test_without_a_token_the_admin_api_answers_loopback_and_named_networks_only(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    async with http.get(router.url + "/workers") as r:  # this test calls from loopback
        assert r.status == 200 and [w["url"] for w in (await r.json())["workers"]] == [engine.url]
    # documentation addresses (RFC 5737, 3849): no host's own
    alone, named = Trust(()), Trust(("203.0.113.0/24", "2001:db8::/32", "198.51.100.1"))
    assert alone.trusts("127.0.0.1") and alone.trusts("::1") and alone.trusts("127.3.0.9")
    assert not alone.trusts("203.0.113.3") and not alone.trusts(None) and not alone.trusts("")
    assert named.trusts("203.0.113.3") and named.trusts("2001:db8::5")
    assert named.trusts("198.51.100.1") and not named.trusts("198.51.100.2")
    with pytest.raises(ConfigError, match="admin_from"):
        validate(RouterConfig(admin_from=("10.0.0.0/33",)))


async def test_dp_aware_off_warns_at_start_up_and_for_each_dp_engine(
    start_cluster: StartCluster, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    (engine,) = (
        await start_cluster([EngineConfig(persona="sglang", dp_size=4, dp_attention=True)])
    ).servers
    with caplog.at_level("WARNING", logger="dprouter"):
        await start_router(RouterConfig(workers=workers(engine.url), dp_aware="off"))
    messages = [r.getMessage() for r in caplog.records]
    assert any("DP-aware routing is OFF" in m and "Use --dp-aware auto" in m for m in messages)
    assert any("w0 runs 4 DP ranks with DP attention but DP-aware" in m for m in messages)


async def test_sglang_load_is_scraped_per_rank_and_an_odd_worker_does_not_stop_it(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(persona="sglang", dp_size=2)])).servers

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"dp_size": 1})

    async def odd_loads(_: web.Request) -> web.Response:
        return web.json_response([1, 2, 3])  # not the shape anyone expects

    app = web.Application()
    app.router.add_get("/server_info", info)
    app.router.add_get("/v1/loads", odd_loads)
    async with serving(app) as odd:
        router = await start_router(
            RouterConfig(workers=workers(odd, engine.url), load_interval=0.05)
        )

        async def busy() -> None:
            body = {"text": "x", "sampling_params": {"max_new_tokens": 300}, "routed_dp_rank": 1}
            async with http.post(engine.url + "/generate", json=body) as r:
                await r.read()

        async with background(busy(), busy()):
            for _ in range(100):
                if [t.reported for t in router.registry.workers["w1"].targets] == [0, 2]:
                    break
                await asyncio.sleep(0.02)
            assert [t.reported for t in router.registry.workers["w1"].targets] == [0, 2]
