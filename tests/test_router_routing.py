"""The router in front of simulated engines: which rank each request really reached."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from dprouter.config import RouterConfig
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, RankLimits
from tests.conftest import StartCluster, StartRouter, serving, workers
from tests.test_sim_vllm import sse_events

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


def engine_ranks(servers: Iterable[SimServer]) -> Counter[tuple[str, int | None]]:
    return Counter((s.engine_id, rec.rank) for s in servers for rec in s.received)


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
    counts = engine_ranks(cluster.servers)
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


@pytest.mark.parametrize("legacy", [False, True], ids=["attn_dp_size", "dp_size"])
async def test_sglang_dp_attention_is_routed_per_rank_with_no_dp_option(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    legacy: bool,
) -> None:
    """SGLang 0.5.23 reports attention DP as ``dp_size: 1, attn_dp_size: 4``; older SGLang
    as ``dp_size: 4, enable_dp_attention``. Either way: four targets, one per rank."""
    config = EngineConfig(persona="sglang", dp_size=4, dp_attention=True, legacy_sglang=legacy)
    (engine,) = (await start_cluster([config])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    (worker,) = router.registry.workers.values()
    assert (worker.dialect, worker.ranks, worker.dp_attention) == ("sglang", 4, True)
    seen = await served_by(http, router.url, 8)
    assert [rank for _, rank in seen] == ["0", "1", "2", "3"] * 2
    # a session key sticks to one rank of the engine, on SGLang's own endpoint too
    sticky = await start_router(RouterConfig(workers=workers(engine.url), sessions=True))
    ranks = []
    for _ in range(8):
        body = {"text": "mine", "sampling_params": {"max_new_tokens": 2}}
        headers = {"X-SMG-Routing-Key": "alice"}
        async with http.post(sticky.url + "/generate", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            ranks.append(r.headers["x-sim-dp-rank"])
    assert len(set(ranks)) == 1
    last = list(engine.received)[-8:]
    assert [rec.body["routed_dp_rank"] for rec in last] == [int(ranks[0])] * 8


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


async def test_sglang_override_headers_never_reach_an_engine(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """SGLang lets ``X-Override-*`` headers replace body fields when started with
    SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES: a client's would pin a rank behind the
    router's back or point a decode at another server. Even a trusted client's."""
    (engine,) = (await start_cluster([EngineConfig(persona="sglang", dp_size=2)])).servers
    overrides = {
        "X-Override-Routed-Dp-Rank": "1",
        "X-Override-Disagg-Prefill-Dp-Rank": "1",
        "X-Override-Rid": "not-the-routers",
        "X-Override-Bootstrap-Host": "10.0.0.66",
        "X-Override-Bootstrap-Port": "1",
        "X-Override-Bootstrap-Room": "7",
        "X-Override-Priority": "3",  # a preference, not routing: passed on
    }
    for trust in (False, True):
        router = await start_router(
            RouterConfig(workers=workers(engine.url), trust_client_rank=trust)
        )
        assert await served_by(http, router.url, 1, PROMPT, overrides) == [("engine-0", "0")]
        sent = {k.lower() for k in engine.received[-1].headers}
        assert sent & {k.lower() for k in overrides} == {"x-override-priority"}


async def test_sessions_stick_and_new_ones_go_to_the_least_loaded_target(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=2), EngineConfig(dp_size=2)])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), sessions=True))
    assert (router.config.policy, router.config.assignment) == ("manual", "min_load")
    long = {"prompt": "keep busy", "max_tokens": 3000, "stream": True}
    busy = [await http.post(router.url + "/v1/completions", json=long) for _ in range(3)]
    try:
        held = {(r.headers["x-sim-engine"], r.headers["x-sim-dp-rank"]) for r in busy}
        assert len(held) == 3  # keyless requests fill idle targets first
        seen = await served_by(http, router.url, 3, PROMPT, {"X-Session-ID": "alice"})
        assert len(set(seen)) == 1 and seen[0] not in held  # the one idle target
    finally:
        for r in busy:
            r.close()
    again = await served_by(http, router.url, 2, PROMPT, {"X-Session-ID": "alice"})
    assert set(again) == {seen[0]}  # still there once the others are idle too
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


async def test_model_cards_pass_through_merged_per_model(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    short = EngineConfig(model="alpha", limits=RankLimits(max_model_len=4096, kv_tokens=8192))
    a, b, c = (
        await start_cluster([EngineConfig(model="alpha"), short, EngineConfig(model="beta")])
    ).servers
    router = await start_router(RouterConfig(workers=workers(a.url, b.url, c.url)))
    async with http.get(router.url + "/v1/models") as r:
        cards = {m["id"]: m for m in (await r.json())["data"]}
    assert list(cards) == ["alpha", "beta"]
    async with http.get(a.url + "/v1/models") as r:
        (engine_card,) = (await r.json())["data"]
    # the engine's own fields; max_model_len: the least of those that serve it (b's 4096)
    assert cards["alpha"] == {**engine_card, "max_model_len": 4096}
    assert cards["beta"]["max_model_len"] == 32_768 and cards["beta"]["owned_by"] == "vllm"
    async with http.get(router.url + "/v1/models/beta") as r:
        assert r.status == 200 and await r.json() == cards["beta"]
    async with http.get(router.url + "/v1/models/gamma") as r:
        assert r.status == 404
        assert (await r.json())["error"]["message"] == "The model `gamma` does not exist."


async def test_a_model_name_no_worker_lists_still_reaches_sglang(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """SGLang serves whatever name a client writes ("default" is common): such a name goes
    to SGLang workers, never to a vLLM worker (which would refuse it)."""
    vllm, sglang = (
        await start_cluster([EngineConfig(model="alpha"), EngineConfig(persona="sglang")])
    ).servers
    router = await start_router(RouterConfig(workers=workers(vllm.url, sglang.url)))
    seen = await served_by(http, router.url, 4, {**PROMPT, "model": "default"})
    assert {e for e, _ in seen} == {sglang.engine_id}
    assert [rec.body["model"] for rec in sglang.received] == ["default"] * 4
    only_vllm = await start_router(RouterConfig(workers=workers(vllm.url)))
    async with http.post(
        only_vllm.url + "/v1/completions", json={**PROMPT, "model": "default"}
    ) as r:
        assert r.status == 404  # nothing could serve it


async def test_generate_takes_max_new_tokens_zero_as_sglang_does(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    got: list[Any] = []

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"dp_size": 1, "attn_dp_size": 1})

    async def generate(request: web.Request) -> web.Response:
        got.append(await request.json())
        return web.json_response({"text": "", "meta_info": {"completion_tokens": 0}})

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_post("/generate", generate)
    async with serving(app) as url:
        router = await start_router(RouterConfig(workers=workers(url)))
        body = {"text": "prefill only", "sampling_params": {"max_new_tokens": 0}}
        async with http.post(router.url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
        body["sampling_params"] = {"max_new_tokens": -1}
        async with http.post(router.url + "/generate", json=body) as r:
            assert r.status == 400
            assert "max_new_tokens must be at least 0" in (await r.json())["error"]["message"]
    assert [b["sampling_params"] for b in got] == [{"max_new_tokens": 0}]


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


async def test_a_header_the_client_repeats_reaches_the_engine_repeated(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    sent = [("X-Trace", "a"), ("X-Trace", "b"), ("Content-Type", "application/json")]
    async with http.post(
        router.url + "/v1/completions", data=orjson.dumps(PROMPT), headers=sent
    ) as r:
        assert r.status == 200
    (rec,) = engine.received
    assert rec.headers.getall("X-Trace") == ["a", "b"]


async def test_a_clients_expect_100_continue_is_answered_by_the_router_not_forwarded(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    async with http.post(router.url + "/v1/completions", json=PROMPT, expect100=True) as r:
        assert r.status == 200
    (rec,) = engine.received
    assert "Expect" not in rec.headers  # the router holds the whole body: nothing to expect


async def test_round_robin_keeps_a_counter_per_pool(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    a, b = (
        await start_cluster(
            [
                EngineConfig(dp_size=2, model="alpha"),
                EngineConfig(dp_size=2, model="beta"),
            ]
        )
    ).servers
    router = await start_router(RouterConfig(workers=workers(a.url, b.url)))
    for _ in range(4):  # alternating models must not alias onto one rank of each
        for model in ("alpha", "beta"):
            await served_by(http, router.url, 1, {**PROMPT, "model": model})
    assert engine_ranks([a, b]) == {
        ("engine-0", 0): 2,
        ("engine-0", 1): 2,
        ("engine-1", 0): 2,
        ("engine-1", 1): 2,
    }


async def test_a_trusted_client_rank_picks_the_target(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    vllm, sglang = (
        await start_cluster(
            [
                EngineConfig(dp_size=4),
                EngineConfig(persona="sglang", dp_size=4),
            ]
        )
    ).servers
    router = await start_router(
        RouterConfig(workers=workers(vllm.url, sglang.url), trust_client_rank=True)
    )
    by_header = await served_by(http, router.url, 2, PROMPT, {"X-data-parallel-rank": "2"})
    by_body = await served_by(http, router.url, 2, {**PROMPT, "routed_dp_rank": 3})
    assert by_header == [("engine-0", "2"), ("engine-1", "2")]
    assert by_body == [("engine-0", "3"), ("engine-1", "3")]
    async with http.post(router.url + "/v1/completions", json={**PROMPT, "routed_dp_rank": 9}) as r:
        assert r.status == 400 and "no target has dp_rank 9" in await r.text()
    async with http.post(
        router.url + "/v1/completions", json=PROMPT, headers={"X-data-parallel-rank": "two"}
    ) as r:
        assert r.status == 400


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (4, 1), (1, 8), (2, 8), (3, 8)], ids=str)
async def test_role_shapes_are_covered_exactly_evenly(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    shape: tuple[int, int],
) -> None:
    engines, dp = shape
    cluster = await start_cluster([EngineConfig(dp_size=dp)] * engines)
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    await served_by(http, router.url, 2 * engines * dp)
    counts = engine_ranks(cluster.servers)
    assert len(counts) == engines * dp and set(counts.values()) == {2}


async def test_chat_and_generate_through_the_router(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    vllm, sglang = (
        await start_cluster(
            [
                EngineConfig(dp_size=2),
                EngineConfig(persona="sglang", dp_size=2),
            ]
        )
    ).servers
    router = await start_router(RouterConfig(workers=workers(vllm.url, sglang.url)))
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    async with http.post(router.url + "/v1/chat/completions", json=chat) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["message"]["role"] == "assistant"
    async with http.post(router.url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
        events = sse_events(await r.read())
    assert events[-1] == b"[DONE]" and len(events) == 5  # role, 3 tokens, [DONE]
    gen = {"text": "go", "sampling_params": {"max_new_tokens": 2}}
    ranks = []
    for _ in range(4):  # /generate is SGLang's own: only the SGLang worker, rank by rank
        async with http.post(router.url + "/generate", json=gen) as r:
            assert r.status == 200 and r.headers["x-sim-engine"] == sglang.engine_id
            ranks.append(r.headers["x-sim-dp-rank"])
    assert ranks == ["0", "1", "0", "1"]
    generate_bodies = [rec.body for rec in sglang.received if rec.path == "/generate"]
    assert [b["routed_dp_rank"] for b in generate_bodies] == [0, 1, 0, 1]


async def test_metrics_per_target(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    await served_by(http, router.url, 4)
    async with http.post(router.url + "/v1/completions", data=b"{") as r:
        assert r.status == 400
    async with http.get(router.url + "/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    answered = {
        (s.labels["worker"], s.labels["dp_rank"], s.labels["status"]): s.value
        for s in families["dprouter_requests"].samples
        if s.name.endswith("_total")
    }
    assert answered == {("w0", "0", "200"): 2.0, ("w0", "1", "200"): 2.0}
    for name in ("dprouter_time_to_first_byte_seconds", "dprouter_request_duration_seconds"):
        counts = {
            s.labels["dp_rank"]: s.value
            for s in families[name].samples
            if s.name.endswith("_count")
        }
        assert counts == {"0": 2.0, "1": 2.0}
    rejected = [s for s in families["dprouter_rejected"].samples if s.name.endswith("_total")]
    assert [(s.labels["cause"], s.value) for s in rejected] == [("bad_request", 1.0)]
    outstanding = [s.value for s in families["dprouter_outstanding"].samples]
    assert outstanding == [0.0, 0.0]
