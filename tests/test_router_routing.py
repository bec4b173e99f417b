"""The router in front of simulated engines: which rank each request really reached."""

from __future__ import annotations

from collections import Counter
from typing import Any

import aiohttp

from dprouter.config import RouterConfig
from dprouter.sim.cluster import SimCluster
from dprouter.sim.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, workers

VLLM_DP8 = EngineConfig(persona="vllm", dp_size=8)
PROMPT: dict[str, Any] = {"prompt": "route me", "max_tokens": 2}


async def served_by(
    http: aiohttp.ClientSession,
    url: str,
    n: int,
    body: dict[str, Any] = PROMPT,
    headers: dict[str, str] | None = None,
) -> list[tuple[str, str]]:
    """(engine, rank) that served each of ``n`` sequential requests."""
    out = []
    for _ in range(n):
        async with http.post(url + "/v1/completions", json=body, headers=headers or {}) as r:
            assert r.status == 200, await r.text()
            out.append((r.headers["x-sim-engine"], r.headers["x-sim-dp-rank"]))
    return out


def engine_ranks(cluster: SimCluster) -> Counter[tuple[str, int | None]]:
    return Counter((s.engine_id, rec.rank) for s in cluster.servers for rec in s.received)


async def test_two_dp8_workers_16_requests_reach_16_distinct_targets(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([VLLM_DP8, VLLM_DP8])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    seen = await served_by(http, router.url, 16)
    assert len(set(seen)) == 16
    assert seen[:4] == [("engine-0", "0"), ("engine-1", "0"), ("engine-0", "1"), ("engine-1", "1")]


async def test_mixed_dp_fleet_is_covered_evenly_over_whole_cycles(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster(
        [
            EngineConfig(dp_size=1),
            EngineConfig(dp_size=2),
            EngineConfig(persona="sglang", dp_size=4, dp_attention=True),
        ]
    )
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    assert len(router.registry.snapshot.pool()) == 7
    await served_by(http, router.url, 7 * 3)
    counts = engine_ranks(cluster)
    assert len(counts) == 7 and set(counts.values()) == {3}


async def test_each_engine_gets_the_rank_in_its_dialect(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    vllm, sglang, single = (
        await start_cluster(
            [
                EngineConfig(dp_size=2),
                EngineConfig(persona="sglang", dp_size=2),
                EngineConfig(),
            ]
        )
    ).servers
    router = await start_router(RouterConfig(workers=workers(vllm.url, sglang.url, single.url)))
    await served_by(http, router.url, 5)
    v = [rec for rec in vllm.received]
    assert [r.headers.get("X-data-parallel-rank") for r in v] == ["0", "1"]
    assert all("routed_dp_rank" not in r.body for r in v)
    s = [rec for rec in sglang.received]
    assert [(r.body["routed_dp_rank"], r.body["data_parallel_rank"]) for r in s] == [(0, 0), (1, 1)]
    assert all("X-data-parallel-rank" not in r.headers for r in s)
    (one,) = single.received
    assert "X-data-parallel-rank" not in one.headers and "routed_dp_rank" not in one.body


async def test_sglang_dp_attention_is_routed_per_rank_with_no_dp_option(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (
        await start_cluster([EngineConfig(persona="sglang", dp_size=4, dp_attention=True)])
    ).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    (worker,) = router.registry.workers.values()
    assert (worker.dialect, worker.ranks, worker.dp_attention) == ("sglang", 4, True)
    seen = await served_by(http, router.url, 8)
    assert [rank for _, rank in seen] == ["0", "1", "2", "3"] * 2


async def test_client_ranks_are_stripped_unless_trusted(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    vllm, sglang = (
        await start_cluster([EngineConfig(dp_size=4), EngineConfig(persona="sglang")])
    ).servers
    router = await start_router(RouterConfig(workers=workers(vllm.url, sglang.url)))
    body = {**PROMPT, "routed_dp_rank": 3, "data_parallel_rank": 3}
    seen = await served_by(http, router.url, 2, body, {"X-data-parallel-rank": "3"})
    assert seen == [("engine-0", "0"), ("engine-1", "0")]  # the router's choice, not the client's
    (s,) = sglang.received
    assert "routed_dp_rank" not in s.body and "X-data-parallel-rank" not in s.headers
    # trusted, and with the rank left to the engine: the client's own rank goes through
    trusting = await start_router(
        RouterConfig(workers=workers(vllm.url), trust_client_rank=True, dp_aware="off")
    )
    seen = await served_by(http, trusting.url, 2, PROMPT, {"X-data-parallel-rank": "3"})
    assert seen == [("engine-0", "3")] * 2


async def test_sessions_stick_to_one_target(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([VLLM_DP8, VLLM_DP8])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), sessions=True))
    assert router.config.policy == "manual"
    homes = {}
    for session in ("alice", "bob", "carol"):
        seen = await served_by(http, router.url, 4, PROMPT, {"X-Session-ID": session})
        assert len(set(seen)) == 1, seen
        homes[session] = seen[0]
    assert len(set(homes.values())) == 3  # min_load puts new sessions on idle targets
    body_key = await served_by(http, router.url, 3, {**PROMPT, "user": "dave"})
    assert len(set(body_key)) == 1


async def test_dp_aware_off_names_no_rank(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=4)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), dp_aware="off"))
    assert [t.label for t in router.registry.snapshot.pool()] == ["w0"]
    await served_by(http, router.url, 4)
    assert all("X-data-parallel-rank" not in rec.headers for rec in engine.received)


async def test_ipv6_loopback_worker_and_router(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)], "::1")).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), host="::1"))
    assert router.url.startswith("http://[::1]:")
    assert [w.url for w in router.registry.workers.values()] == [engine.url]
    assert {rank for _, rank in await served_by(http, router.url, 4)} == {"0", "1"}


async def test_models_union_and_unknown_model(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    a, b = (await start_cluster([EngineConfig(model="alpha"), EngineConfig(model="beta")])).servers
    router = await start_router(RouterConfig(workers=workers(a.url, b.url)))
    async with http.get(router.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["alpha", "beta"]
    for model, engine in (("alpha", "engine-0"), ("beta", "engine-1")):
        seen = await served_by(http, router.url, 2, {**PROMPT, "model": model})
        assert {e for e, _ in seen} == {engine}
    async with http.post(router.url + "/v1/completions", json={**PROMPT, "model": "gamma"}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["message"] == "The model `gamma` does not exist."


async def test_client_authorization_reaches_engines_only_when_configured(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    auth = {"Authorization": "Bearer client-key"}
    plain = await start_router(RouterConfig(workers=workers(engine.url)))
    forwarding = await start_router(
        RouterConfig(workers=workers(engine.url), forward_authorization=True)
    )
    await served_by(http, plain.url, 1, PROMPT, auth)
    await served_by(http, forwarding.url, 1, PROMPT, auth)
    assert [rec.headers.get("Authorization") for rec in engine.received] == [
        None,
        "Bearer client-key",
    ]
