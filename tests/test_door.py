"""The front door's limits and classes: tenants held to their rates and requests in
flight (exactly, under ``--processes 2`` too), and requests held in the router by class
when every rank's running slots are taken, the lowest shed first.

With no keys configured every request is the default tenant's (``anonymous``); a default
that may set its class takes ``X-Priority``. The simulated SGLang engines report their
running caps, so the dispatcher holds what they cannot run; what they received shows
what the router let through."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from dprouter.config import RouterConfig
from dprouter.core.types import Caller, Incoming
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.proxy.dispatch import Held, Line
from dprouter.sim.model.config import CostModel, EngineConfig, PdConfig, RankLimits
from tests.conftest import (
    StartCluster,
    StartProcesses,
    StartRouter,
    metric_sum,
    until,
    workers,
)
from tests.test_dispatch import Queued

SGLANG = EngineConfig(
    persona="sglang",
    dp_size=2,
    dp_attention=True,
    limits=RankLimits(max_running=2),
    time_scale=0.3,
)


def tenants_file(tmp_path: Path, default: dict[str, Any], **tenants: dict[str, Any]) -> str:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"default": default, "tenants": tenants}))
    return str(path)


def body(text: str, tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    return {"prompt": text, "max_tokens": tokens, "ignore_eos": True, "stream": stream}


async def status(
    http: aiohttp.ClientSession, url: str, sent: dict[str, Any], **headers: str
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with http.post(url + "/v1/completions", json=sent, headers=headers) as r:
        answer = await r.json(content_type=None) if not sent.get("stream") else {}
        if sent.get("stream"):
            await r.read()
        return r.status, answer, dict(r.headers)


async def test_a_tenants_request_rate_is_held_with_a_429_naming_the_limit(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(time_scale=0.1)])).servers
    # 0.01 a second, a bucket of 300 s of it: 3 requests, then none for ~100 s
    limits = {"requests_per_second": 0.01, "burst": 300}
    config = RouterConfig(
        workers=workers(engine.url), tenants=tenants_file(tmp_path, {"limits": limits})
    )
    router = await start_router(config)
    answers = [await status(http, router.url, body(f"r{i}")) for i in range(5)]
    assert [a[0] for a in answers] == [200, 200, 200, 429, 429]
    _, error, headers = answers[3]
    assert error["error"]["param"] == "requests_per_second"
    assert "anonymous" in error["error"]["message"] and "0.01" in error["error"]["message"]
    assert 90 <= int(headers["Retry-After"]) <= 101  # a request's worth of the rate
    assert len(engine.received) == 3  # the refused never reached the engine
    limited = await metric_sum(http, router.url, "dprouter_tenant_limited_total")
    assert limited == 2
    assert await metric_sum(http, router.url, "dprouter_tenant_admitted_total") == 3


async def test_a_tenants_tokens_count_prompt_and_output_budget(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(time_scale=0.1)])).servers
    limits = {"tokens_per_second": 0.01, "burst": 100_000}  # a bucket of 1,000 tokens
    config = RouterConfig(
        workers=workers(engine.url), tenants=tenants_file(tmp_path, {"limits": limits})
    )
    router = await start_router(config)
    first = await status(http, router.url, body("one", 400))
    second = await status(http, router.url, body("two", 400))
    third = await status(http, router.url, body("three", 400))  # ~200 tokens left
    assert (first[0], second[0], third[0]) == (200, 200, 429)
    assert third[1]["error"]["param"] == "tokens_per_second"
    assert "prompt + max_tokens" in third[1]["error"]["message"]
    assert len(engine.received) == 2


async def test_a_tenants_requests_in_flight_are_capped_until_one_ends(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(time_scale=0.3)])).servers
    config = RouterConfig(
        workers=workers(engine.url),
        tenants=tenants_file(tmp_path, {"limits": {"in_flight": 1}}),
    )
    router = await start_router(config)
    async with http.post(router.url + "/v1/completions", json=body("long", 60, True)) as r:
        assert r.status == 200
        await r.content.readline()  # under way
        refused = await status(http, router.url, body("while"))
        assert refused[0] == 429 and refused[1]["error"]["param"] == "in_flight"
        await r.read()  # its last byte: its place in flight is given back
    assert (await status(http, router.url, body("after")))[0] == 200


async def fresh_post(url: str, sent: dict[str, Any]) -> int:
    """One request on a connection of its own, so either serving process may take it."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + "/v1/completions", json=sent) as r,
    ):
        await r.read()
        return r.status


async def test_limits_hold_exactly_across_two_serving_processes(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_processes: StartProcesses,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2, time_scale=0.1)])).servers
    limits = {"requests_per_second": 0.01, "burst": 1000}  # 10 requests in all
    config = RouterConfig(
        workers=workers(engine.url), tenants=tenants_file(tmp_path, {"limits": limits})
    )
    sup = await start_processes(config)
    statuses = await asyncio.gather(*(fresh_post(sup.url, body(f"p{i}")) for i in range(30)))
    assert sorted(statuses) == [200] * 10 + [429] * 20
    assert len(engine.received) == 10


async def test_requests_in_flight_hold_exactly_across_two_serving_processes(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_processes: StartProcesses,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2, time_scale=1.0)])).servers
    config = RouterConfig(
        workers=workers(engine.url),
        tenants=tenants_file(tmp_path, {"limits": {"in_flight": 3}}),
    )
    sup = await start_processes(config)
    # each runs ~0.5 s: all 12 arrive while the first 3 run
    statuses = await asyncio.gather(*(fresh_post(sup.url, body(f"f{i}", 60)) for i in range(12)))
    assert sorted(statuses) == [200] * 3 + [429] * 9
    assert len(engine.received) == 3


async def test_held_requests_go_by_class_across_two_serving_processes(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_processes: StartProcesses,
    http: aiohttp.ClientSession,
) -> None:
    """4 running slots (2 ranks x 2), 4 long low requests run in them and 12 more are held,
    each on a connection of its own: either serving process holds it. Then 4 high ones
    arrive the same way. Each slot that frees goes to a high one, whichever process it
    freed in and whichever holds the highs: the classes hold across processes."""
    (engine,) = (await start_cluster([replace(SGLANG, time_scale=1.0)])).servers
    config = RouterConfig(
        workers=workers(engine.url), tenants=tenants_file(tmp_path, {"set_class": True})
    )
    sup = await start_processes(config)
    slots = [t.slot for t in sup.registry.targets()]
    assert await until(lambda: all(sup.board.cap[slots]))  # the engine's caps are read

    async def post(text: str, tokens: int, priority: str) -> int:
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as s,
            s.post(
                sup.url + "/v1/completions",
                json=body(text, tokens),
                headers={"X-Priority": priority},
            ) as r,
        ):
            await r.read()
            return r.status

    running = [asyncio.create_task(post(f"run{i}", 300, "low")) for i in range(4)]
    assert await until(lambda: len(engine.received) == 4)
    lows = [asyncio.create_task(post(f"low{i}", 8, "low")) for i in range(12)]
    assert await held_everywhere(http, sup.url, 12)
    highs = [asyncio.create_task(post(f"high{i}", 8, "high")) for i in range(4)]
    assert await held_everywhere(http, sup.url, 16)
    assert len(engine.received) == 4, "the runners ended before the highs were held"
    statuses = await asyncio.gather(*running, *lows, *highs)
    assert statuses == [200] * 20
    prompts = [r.body["prompt"] for r in engine.received]
    assert sorted(prompts[4:8]) == [f"high{i}" for i in range(4)], prompts


async def test_held_requests_go_by_class_and_a_full_queue_sheds_the_lowest(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """4 running slots (2 ranks x 2): 4 low requests run, 4 more are held (the bound). Two
    high ones arrive: each sheds the newest low held (503) and goes before the others; a
    low one arriving to the full queue is shed itself. None of the rest is lost."""
    (engine,) = (await start_cluster([SGLANG])).servers
    config = RouterConfig(
        workers=workers(engine.url),
        tenants=tenants_file(tmp_path, {"set_class": True}),
        dispatch_queue=4,
    )
    router = await start_router(config)
    low = [
        asyncio.create_task(status(http, router.url, body(f"low{i}", 40), **{"X-Priority": "low"}))
        for i in range(8)
    ]
    assert await until(lambda: len(engine.received) == 4 and held(router) == 4)
    high = [
        asyncio.create_task(status(http, router.url, body(f"high{i}", 4), **{"X-Priority": "high"}))
        for i in range(2)
    ]
    assert await until(lambda: held(router) == 4)  # 2 lows shed, 2 highs held
    late = await status(http, router.url, body("late", 4), **{"X-Priority": "low"})
    assert late[0] == 503 and "none of a lower class" in late[1]["error"]["message"]
    lows = await asyncio.gather(*low)
    highs = await asyncio.gather(*high)
    assert [h[0] for h in highs] == [200, 200]
    assert sorted(s for s, _, _ in lows) == [200] * 6 + [503] * 2
    shed = [i for i, (s, _, _) in enumerate(lows) if s == 503]
    assert shed == [6, 7]  # the newest lows made room
    assert all("made room for a higher one" in lows[i][1]["error"]["message"] for i in shed)
    prompts = [r.body["prompt"] for r in engine.received]
    assert prompts[4:6] == ["high0", "high1"]  # the highs went before the held lows
    assert sorted(prompts) == sorted(["high0", "high1"] + [f"low{i}" for i in range(6)])
    assert await metric_sum(http, router.url, "dprouter_tenant_shed_total", why="shed") == 2
    assert await metric_sum(http, router.url, "dprouter_tenant_shed_total", why="queue_full") == 1


def held(router: Any) -> int:
    return int(router.parts.proxy.parts.dispatch.held)


async def held_everywhere(http: aiohttp.ClientSession, url: str, n: int) -> bool:
    """Whether the serving processes behind ``url`` come to hold ``n`` requests in all
    (their gauge, summed), within 5 s."""
    for _ in range(250):
        if await metric_sum(http, url, "dprouter_held_requests") == n:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_pd_requests_are_held_by_class_until_a_decode_slot_frees(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """SGLang P/D, a decode of 4 running slots (2 ranks x 2): 4 low requests run, 4 more
    wait in the router, not on the engines; two high ones sent then go before them, on
    both legs. Every request is answered, each leg sent once."""
    prefill = EngineConfig(persona="sglang", pd=PdConfig("sglang", "prefill"), time_scale=0.3)
    decode = replace(SGLANG, dp_attention=False, pd=PdConfig("sglang", "decode"))
    cluster = await start_cluster([prefill, decode])
    p, d = cluster.servers
    specs = (WorkerSpec(p.url, role="prefill"), WorkerSpec(d.url, role="decode"))
    config = RouterConfig(
        pd="sglang", workers=specs, tenants=tenants_file(tmp_path, {"set_class": True})
    )
    router = await start_router(config)
    async with Queued(d) as queued:
        low = [
            asyncio.create_task(
                status(http, router.url, body(f"low{i}", 40), **{"X-Priority": "low"})
            )
            for i in range(8)
        ]
        assert await until(lambda: len(d.received) == 4 and held(router) == 4)
        assert len(p.received) == 4  # a held request's prefill waits with it
        high = [
            asyncio.create_task(
                status(http, router.url, body(f"high{i}", 4), **{"X-Priority": "high"})
            )
            for i in range(2)
        ]
        assert await until(lambda: held(router) == 6)
        answers = await asyncio.gather(*low, *high)
    assert [s for s, _, _ in answers] == [200] * 10, answers
    assert queued.most == 2  # no decode rank queued one beyond its 2 running: the router held
    for engine in (p, d):
        prompts = [r.body["prompt"] for r in engine.received]
        assert prompts[4:6] == ["high0", "high1"], prompts  # before the held lows
        assert sorted(prompts) == sorted([f"low{i}" for i in range(8)] + ["high0", "high1"])


async def test_a_held_pd_request_that_times_out_or_is_left_leaves_no_count_behind(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The decode's 4 slots taken: a P/D request held past ``--dispatch-wait`` gets a 503,
    one whose client leaves while held reaches neither engine, and once all is done no
    target of either role counts a request (no leg claimed for nothing)."""
    prefill = EngineConfig(persona="sglang", pd=PdConfig("sglang", "prefill"), time_scale=0.3)
    decode = replace(SGLANG, dp_attention=False, pd=PdConfig("sglang", "decode"))
    p, d = (await start_cluster([prefill, decode])).servers
    specs = (WorkerSpec(p.url, role="prefill"), WorkerSpec(d.url, role="decode"))
    router = await start_router(RouterConfig(pd="sglang", workers=specs, dispatch_wait=0.5))
    running = [asyncio.create_task(status(http, router.url, body(f"r{i}", 1000))) for i in range(4)]
    assert await until(lambda: len(d.received) == 4)
    late = await status(http, router.url, body("late"))
    assert late[0] == 503 and "no rank had a free running slot" in late[1]["error"]["message"]
    left = asyncio.create_task(status(http, router.url, body("left")))
    assert await until(lambda: held(router) == 1)
    left.cancel()
    await asyncio.gather(left, return_exceptions=True)
    assert await until(lambda: held(router) == 0)
    assert [s for s, _, _ in await asyncio.gather(*running)] == [200] * 4
    prompts = {r.body["prompt"] for e in (p, d) for r in e.received}
    assert prompts == {f"r{i}" for i in range(4)}
    assert await until(lambda: all(t.load == 0 for t in router.registry.targets()))


async def test_an_unknown_class_is_a_400_and_a_tenant_that_may_not_choose_keeps_its_own(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(time_scale=0.1)])).servers
    choosing = await start_router(
        RouterConfig(
            workers=workers(engine.url), tenants=tenants_file(tmp_path, {"set_class": True})
        )
    )
    bad = await status(http, choosing.url, body("x"), **{"X-Priority": "urgent"})
    assert bad[0] == 400 and "high, normal, low" in bad[1]["error"]["message"]
    fixed = await start_router(RouterConfig(workers=workers(engine.url)))
    assert (await status(http, fixed.url, body("x"), **{"X-Priority": "urgent"}))[0] == 200


async def test_under_overload_the_high_class_never_waits_for_a_slot(
    tmp_path: Path,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """Low requests offered at twice what the fleet runs; a stream of high requests meanwhile
    never waits for a running slot, neither in the router (each goes in the step it comes:
    a slot of each rank is kept for it, ``--reserve``) nor in the engine (the router never
    sends a rank more than it runs, so none arrives to a full batch), while lows are held
    and shed with 503s; and every request the router let in is answered. What that is
    worth in time to first token is measured by ``dprouter bench overload``, not here: a
    busy 2-core machine moved a timed bound of it by 2x."""
    cost = CostModel(step_base=0.005, prefill_per_token=5e-4)
    slow = replace(SGLANG, limits=RankLimits(max_running=3), time_scale=1.0, cost=cost)
    (engine,) = (await start_cluster([slow])).servers
    config = RouterConfig(
        workers=workers(engine.url),
        tenants=tenants_file(tmp_path, {"set_class": True}),
        reserve=1,
        dispatch_queue=6,
    )
    router = await start_router(config)

    async def high(i: int) -> None:
        sent = body(f"high{i} " + " ".join(f"high{i}w{j}" for j in range(200)), 4, stream=True)
        headers = {"X-Priority": "high"}
        async with http.post(router.url + "/v1/completions", json=sent, headers=headers) as r:
            assert r.status == 200
            assert (await r.read()).rstrip().endswith(b"data: [DONE]")

    lows: list[int] = []

    async def flood() -> None:
        # 2 ranks x 2 slots for lows, 80 tokens x ~5.3 ms each: ~9 a second run; 20 offered
        async def one(i: int) -> None:
            answer = await status(http, router.url, body(f"low{i}", 80), **{"X-Priority": "low"})
            lows.append(answer[0])

        tasks = []
        for i in range(80):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)

    flooding = asyncio.create_task(flood())
    assert await until(lambda: held(router) > 0)
    for i in range(15):  # while the lows are held
        await high(i)
        await asyncio.sleep(0.1)
    await flooding
    waited = {
        cls: await metric_sum(
            http, router.url, "dprouter_tenant_queued_seconds_count", **{"class": cls}
        )
        for cls in ("high", "low")
    }
    assert waited["high"] == 0 and waited["low"] > 0, waited
    assert sum(rank.stats.queued for rank in engine.engine.ranks) == 0
    assert set(lows) <= {200, 503} and lows.count(503) > 0, lows
    received = [r.body["prompt"] for r in engine.received]
    assert sum(p.startswith("high") for p in received) == 15
    assert sum(p.startswith("low") for p in received) == lows.count(200)  # none lost


async def test_within_a_class_tenants_share_the_freed_slots_by_weight() -> None:
    """The held queue's order: the highest class first; within it, tenant B of weight 3
    gets three slots for each of tenant A's (weight 1), however they arrived; within a
    tenant, the dispatcher's own order (its longest predicted output first)."""
    line = Line()

    def held(tenant: str, weight: float, priority: int, output: int, at: float) -> Held:
        caller = Caller(tenant, "user", priority, weight)
        incoming = Incoming({}, None, False, None, "", output, output, caller=caller)
        one = Held(incoming, [], lambda _: None, at)  # type: ignore[arg-type, return-value]
        one.order = (-output, int(at))
        return one

    for i in range(8):  # A's arrive first, all of them
        line.push(held("A", 1.0, 1, 10 + i, float(i)))
    for i in range(8):
        line.push(held("B", 3.0, 1, 10 + i, float(8 + i)))
    line.push(held("C", 1.0, 0, 1, 99.0))  # a higher class, last to arrive
    order = []
    while (first := line.first()) is not None:
        line.pop(first)
        order.append((first.incoming.caller.tenant, first.incoming.output))
    assert order[0] == ("C", 1)
    tenants = "".join(t for t, _ in order[1:])
    assert tenants[:8].count("B") == 6 and tenants[:8].count("A") == 2, tenants
    assert [o for t, o in order if t == "A"] == sorted(range(10, 18), reverse=True)


def test_clients_credentials_for_the_router_are_never_forwarded(tmp_path: Path) -> None:
    from dprouter.config import validate
    from dprouter.core.errors import ConfigError

    tenants = tenants_file(tmp_path, {})
    with pytest.raises(ConfigError, match="--forward-authorization"):
        validate(RouterConfig(forward_authorization=True, tenants=tenants))
    with pytest.raises(ConfigError, match="--forward-authorization"):
        validate(RouterConfig(forward_authorization=True, jwt_issuer="https://issuer.test"))


async def test_a_rank_whose_kv_cache_is_past_the_bound_takes_no_more_requests(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """vLLM reports no running cap, but its KV cache's use and size: with ``--engine-kv
    0.5`` a rank whose token load (its report, plus what was sent since) is half its cache
    or more gets nothing new, so the engine never has to queue a request for want of cache
    (it does without the bound); requests wait in the router meanwhile, and every one is
    answered."""
    limits = RankLimits(kv_tokens=4096, max_model_len=2048)

    async def run(engine_kv: float) -> tuple[int, int]:
        """(the most requests an engine rank kept waiting, the most the router held)"""
        (engine,) = (await start_cluster([EngineConfig(dp_size=2, limits=limits)])).servers
        config = RouterConfig(workers=workers(engine.url), engine_kv=engine_kv, load_interval=0.02)
        router = await start_router(config)
        waiting = held_seen = 0

        async def watch() -> None:
            nonlocal waiting, held_seen
            for _ in range(2_000):  # bounded: ~20 s
                waiting = max(waiting, *(len(r.waiting) for r in engine.engine.ranks))
                held_seen = max(held_seen, held(router))
                await asyncio.sleep(0.01)

        async def one(i: int) -> int:
            await asyncio.sleep(0.05 * i)
            prompt = " ".join(f"p{i}w{j}" for j in range(600))  # ~15 % of a rank
            return (await status(http, router.url, body(prompt, 300)))[0]

        watching = asyncio.create_task(watch())
        statuses = await asyncio.gather(*(one(i) for i in range(16)))
        watching.cancel()
        assert statuses == [200] * 16
        return waiting, held_seen

    unbounded = await run(0.0)
    assert unbounded[0] > 1 and unbounded[1] == 0  # the engine queued them
    waiting, held_seen = await run(0.5)
    assert waiting <= 1 and held_seen > 0  # the router held them (1: until the next step)


@pytest.mark.parametrize(
    ("args", "classes"),
    [([], ("high", "normal", "low")), (["--classes", "gold, bronze"], ("gold", "bronze"))],
)
def test_the_classes_option_reads_as_the_configuration_says(
    args: list[str], classes: tuple[str, ...]
) -> None:
    from dprouter.cli.serve import make_config, serve

    ctx = serve.make_context("serve", args)
    options = {k: v for k, v in ctx.params.items() if k not in ("workers", "config_file")}
    options.pop("log_level")
    assert make_config(ctx, None, (), options).classes == classes
