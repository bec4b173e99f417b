"""P/D through the router against simulated prefill and decode engines."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Literal

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.types import PdMode
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.server.router import Router
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, Faults, PdConfig
from tests.conftest import (
    CutsStreams,
    StartCluster,
    StartRouter,
    completions_engine,
    metric_sum,
    serving,
    stalling,
    stream_ends,
    until,
)
from tests.test_router_proxy import PIECES

Shape = tuple[int, int]  # (instances, dp_size)
PROMPT = {"prompt": "disaggregate me", "max_tokens": 4}
# RFC #46107 role shapes: TP8 is one rank per instance, DP8EP eight
SHAPES: dict[str, tuple[Shape, Shape]] = {
    "1P/1D TP8": ((1, 1), (1, 1)),
    "2P/2D TP8": ((2, 1), (2, 1)),
    "4D TP8": ((1, 1), (4, 1)),
    "1D DP8EP": ((1, 1), (1, 8)),
    "2P DP8EP": ((2, 8), (1, 1)),
    "3D DP8EP": ((1, 1), (3, 8)),
    "2P TP8 -> 1D DP8EP": ((2, 1), (1, 8)),
    "1P DP8EP -> 1D TP8": ((1, 8), (1, 1)),
}


MOONCAKE: PdMode = "vllm-mooncake"


def port(server: SimServer) -> int | None:
    """A simulated prefill's bootstrap port."""
    return None if server.pd is None else server.pd.bootstrap_port


@dataclass
class Deployment:
    router: Router
    prefills: list[SimServer]
    decodes: list[SimServer]


def engine(mode: PdMode, role: Literal["prefill", "decode"], dp: int, **kw: Any) -> EngineConfig:
    config = PdConfig(mode=mode, role=role, **kw)
    return EngineConfig(persona=config.persona, dp_size=dp, pd=config)


async def deploy(
    start_cluster: StartCluster,
    start_router: StartRouter,
    mode: PdMode,
    p: Shape,
    d: Shape,
    transfer: str = "READ",
    faults: Faults | None = None,
    **router: Any,
) -> Deployment:
    kw: dict[str, Any] = {"kv_wait": 2.0}
    if mode == "vllm-moriio":  # the router first: engines need its registration address
        r = await start_router(
            RouterConfig(pd=mode, registration="tcp://127.0.0.1:0", **router), settle=False
        )
        assert r.parts.registration is not None
        kw |= {
            "transfer_mode": transfer,
            "heartbeat": 0.05,
            "registration": r.parts.registration.address,
        }
    # "TP8" shapes: one rank per instance, tensor parallel 8 (their peers are told so)
    configs = [replace(engine(mode, "prefill", p[1], **kw), tp_size=8 if p[1] == 1 else 1)] * p[0]
    configs += [replace(engine(mode, "decode", d[1], **kw), tp_size=8 if d[1] == 1 else 1)] * d[0]
    if faults is not None:
        configs[0] = replace(configs[0], faults=faults)
    cluster = await start_cluster(configs)
    prefills, decodes = cluster.servers[: p[0]], cluster.servers[p[0] :]
    if mode != "vllm-moriio":
        # vLLM does not say where its Mooncake bootstrap server listens: it is configured
        specs = [
            WorkerSpec(s.url, role="prefill", bootstrap_port=port(s) if mode == MOONCAKE else None)
            for s in prefills
        ]
        specs += [WorkerSpec(s.url, role="decode") for s in decodes]
        r = await start_router(RouterConfig(pd=mode, workers=tuple(specs), **router))
    for _ in range(200):
        if len(r.registry.workers) == p[0] + d[0]:
            break
        await asyncio.sleep(0.02)
    assert len(r.registry.workers) == p[0] + d[0]
    return Deployment(r, prefills, decodes)


async def served(
    http: aiohttp.ClientSession, url: str, n: int, body: dict[str, Any] = PROMPT
) -> list[tuple[str, str]]:
    pairs = []
    for i in range(n):
        async with http.post(url + "/v1/completions", json={**body, "stream": i % 2 == 1}) as r:
            text = await r.text()
            assert r.status == 200, text
            assert "error" not in text
            pairs.append((r.headers["x-dprouter-prefill"], r.headers["x-dprouter-target"]))
    return pairs


def ranks(servers: list[SimServer]) -> Counter[tuple[str, int | None]]:
    return Counter((s.engine_id, rec.rank) for s in servers for rec in s.received)


@pytest.mark.parametrize("mode", ["vllm-nixl", "vllm-mooncake", "vllm-moriio", "sglang"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
async def test_every_slot_of_each_role_is_covered_evenly(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    mode: PdMode,
    shape: str,
) -> None:
    p, d = SHAPES[shape]
    dep = await deploy(start_cluster, start_router, mode, p, d)
    p_slots, d_slots = p[0] * p[1], d[0] * d[1]
    n = 2 * p_slots * d_slots if p_slots * d_slots <= 16 else 2 * max(p_slots, d_slots)
    pairs = await served(http, dep.router.url, n)
    prefill_counts, decode_counts = ranks(dep.prefills), ranks(dep.decodes)
    assert len(prefill_counts) == p_slots and set(prefill_counts.values()) == {n // p_slots}
    assert len(decode_counts) == d_slots and set(decode_counts.values()) == {n // d_slots}
    if p_slots * d_slots <= 16:  # P and D are not locked together: every pair occurs
        assert len(set(pairs)) == p_slots * d_slots


async def test_moriio_write_mode_runs_both_legs_at_once(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    dep = await deploy(start_cluster, start_router, "vllm-moriio", (2, 2), (1, 2), "WRITE")
    assert await served(http, dep.router.url, 8)
    assert {w.transfer_mode for w in dep.router.registry.workers.values()} == {"WRITE"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_write_mode_prefill_failure_reaches_the_client_and_leaves_no_decode(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    stream: bool,
) -> None:  # a streaming decode answers its headers before the prefill fails: no matter
    dep = await deploy(
        start_cluster,
        start_router,
        "vllm-moriio",
        (1, 1),
        (1, 2),
        "WRITE",
        faults=Faults(fail_rate=1.0, delay=0.3),
    )
    async with http.post(
        dep.router.url + "/v1/completions", json={**PROMPT, "stream": stream}
    ) as r:
        # the lone prefill engine had its last chance: the client hears its own answer
        assert r.status == 500
        assert "simulated engine failure" in (await r.json())["error"]["message"]
    # the decode leg was waiting for KV (kv_wait is 2 s): the router hung up on it at once
    for _ in range(25):
        if dep.decodes[0].active == 0:
            break
        await asyncio.sleep(0.02)
    assert dep.decodes[0].generation_requests == 1  # it did arrive, and wait...
    assert dep.decodes[0].active == 0  # ...and is gone, long before its KV wait would end
    assert all(t.outstanding == 0 for t in dep.router.registry.targets())


async def test_sglang_room_and_ranks_agree(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    dep = await deploy(start_cluster, start_router, "sglang", (1, 8), (1, 4))
    await served(http, dep.router.url, 8)
    for pre in dep.prefills[0].received:
        assert pre.body["bootstrap_room"] % 8 == pre.body["routed_dp_rank"] == pre.rank
        assert pre.body["disagg_prefill_dp_rank"] == pre.rank  # the real engine needs it
    decode_bodies = [rec.body for rec in dep.decodes[0].received]
    assert {b["disagg_prefill_dp_rank"] for b in decode_bodies} == set(range(8))
    assert all(
        b["routed_dp_rank"] == rec.rank
        for b, rec in zip(decode_bodies, dep.decodes[0].received, strict=True)
    )


@pytest.mark.parametrize("attention", [False, True])
async def test_a_dp_prefill_refuses_no_room_on_any_rank(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    attention: bool,
) -> None:
    """SGLang 0.5.23's prefill under plain DP refused every room that implied a rank other
    than 0 until dprouter told it its rank (the simulated one refuses alike): over plain
    and attention DP, no refusal, no target out, both ranks serving."""
    configs = [
        EngineConfig(
            persona="sglang",
            dp_size=2,
            dp_attention=attention,
            pd=PdConfig(mode="sglang", role=role, kv_wait=2.0),
        )
        for role in ("prefill", "decode")
    ]
    cluster = await start_cluster(configs)
    prefill, decode = cluster.servers
    specs = (WorkerSpec(prefill.url, role="prefill"), WorkerSpec(decode.url, role="decode"))
    router = await start_router(RouterConfig(pd="sglang", workers=specs))
    await served(http, router.url, 16)
    assert Counter(rec.rank for rec in prefill.received) == {0: 8, 1: 8}
    assert all(rec.body["disagg_prefill_dp_rank"] == rec.rank for rec in prefill.received)
    assert not any(t.tripped for t in router.registry.targets())
    assert await metric_sum(http, router.url, "dprouter_upstream_errors_total") == 0


async def test_a_dead_prefill_is_passed_over_before_the_first_byte(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    dep = await deploy(start_cluster, start_router, "vllm-nixl", (2, 1), (1, 2))
    await dep.prefills[0].crash()
    pairs = await served(http, dep.router.url, 4)
    assert {p for p, _ in pairs} == {"p1"}
    assert dep.router.registry.workers["p0"].state == "discovering"


@pytest.mark.parametrize("mode", ["vllm-nixl", "sglang"])
async def test_streamed_decode_passes_through_byte_exact(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    mode: PdMode,
) -> None:
    (prefill,) = (await start_cluster([engine(mode, "prefill", 2)])).servers
    seen: list[dict[str, Any]] = []

    async def decode(request: web.Request) -> web.StreamResponse:
        """A stand-in decode engine that answers in uneven pieces."""
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in PIECES:
            await resp.write(piece)
        await resp.write_eof()
        return resp

    app = completions_engine(decode)
    dialect: Literal["vllm", "sglang"] = "sglang" if mode == "sglang" else "vllm"
    async with serving(app) as url:
        router = await start_router(
            RouterConfig(
                pd=mode,
                workers=(
                    WorkerSpec(prefill.url, role="prefill"),
                    WorkerSpec(url, role="decode", dialect=dialect, dp_size=1),
                ),
            )
        )
        for _ in range(2):
            async with http.post(
                router.url + "/v1/completions",
                json={**PROMPT, "stream": True},
                headers=[("Accept-Encoding", "gzip"), ("X-Trace", "a"), ("X-Trace", "b")],
            ) as r:
                assert await r.read() == b"".join(PIECES)
    # the router reads the prefill's answer itself: it asks for it uncompressed
    assert all(rec.headers["Accept-Encoding"] == "identity" for rec in prefill.received)
    assert all(rec.headers.getall("X-Trace") == ["a", "b"] for rec in prefill.received)
    for body in seen:
        if mode == "sglang":
            assert body["bootstrap_room"] % 2 == body["disagg_prefill_dp_rank"]
        else:
            kv = body["kv_transfer_params"]
            assert kv["remote_engine_id"].startswith(prefill.engine_id + "_dp")  # unchanged
            assert kv["remote_port"] == prefill.port


async def test_registered_instances_expire_and_return(
    start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    router = await start_router(
        RouterConfig(pd="vllm-moriio", registration="tcp://127.0.0.1:0", heartbeat_timeout=0.5),
        settle=False,
    )
    assert router.parts.registration is not None
    beat = {"heartbeat": 0.05, "registration": router.parts.registration.address}
    decode = SimServer(engine("vllm-moriio", "decode", 2, **beat))
    other = SimServer(engine("vllm-moriio", "prefill", 1, transfer_mode="WRITE", **beat))
    workers = router.registry.workers
    try:
        await decode.start()
        assert await until(lambda: len(router.registry.snapshot.pool("decode")) == 2)
        await other.start()  # a WRITE instance in a READ deployment
        assert await until(
            lambda: any(
                "transfer mode WRITE, but this deployment runs READ" in r.getMessage()
                for r in caplog.records
            )
        )
        assert [(w.role, w.ranks) for w in workers.values()] == [("decode", 2)]
        await other.stop()  # (once every READ instance is gone, WRITE ones would be welcome)
        await decode.stop()  # its heartbeats stop
        assert await until(lambda: not workers)
        assert not router.registry.snapshot.pool("decode")
        await decode.start()  # back, and re-admitted
        assert await until(lambda: len(router.registry.snapshot.pool("decode")) == 2)
    finally:
        await decode.stop()
        await other.stop()


async def test_a_refused_request_reaches_the_client_as_the_engine_said(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    dep = await deploy(start_cluster, start_router, "sglang", (2, 1), (2, 1))
    async with http.post(
        dep.router.url + "/v1/completions", json={**PROMPT, "max_tokens": 10**6}
    ) as r:
        assert r.status == 400  # not a 502, and not retried on other pairs
        assert "maximum context length" in (await r.json())["message"]
    assert sum(s.generation_requests for s in dep.prefills) == 1


async def test_a_failing_decode_is_passed_over_and_counted_per_role(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    dep = await deploy(start_cluster, start_router, "sglang", (1, 2), (2, 1))
    await dep.decodes[0].crash()
    pairs = await served(http, dep.router.url, 4)
    assert {d for _, d in pairs} == {"d1"}
    async with http.get(dep.router.url + "/metrics") as r:
        text = await r.text()
    assert 'dprouter_requests_total{dp_rank="",role="decode",status="200",worker="d1"} 4.0' in text
    for rank in ("0", "1"):
        assert (
            f'dprouter_requests_total{{dp_rank="{rank}",role="prefill",status="200",worker="p0"}}'
        ) in text
    assert 'cause="connect",dp_rank="",role="decode",worker="d0"} 1.0' in text


async def test_one_role_may_mix_dp_sizes(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    configs = [
        engine("sglang", "prefill", 2),
        engine("sglang", "prefill", 4),
        engine("sglang", "decode", 1),
        engine("sglang", "decode", 3),
    ]
    cluster = await start_cluster(configs)
    specs = [WorkerSpec(s.url, role=s.config.pd.role) for s in cluster.servers if s.config.pd]
    router = await start_router(RouterConfig(pd="sglang", workers=tuple(specs)))
    await served(http, router.url, 24)  # 6 prefill slots x 4 decode slots
    prefill_counts, decode_counts = ranks(cluster.servers[:2]), ranks(cluster.servers[2:])
    assert len(prefill_counts) == 6 and set(prefill_counts.values()) == {4}
    assert len(decode_counts) == 4 and set(decode_counts.values()) == {6}


async def test_bad_registration_messages_do_not_silence_registration(
    start_router: StartRouter,
) -> None:
    router = await start_router(
        RouterConfig(pd="vllm-moriio", registration="tcp://127.0.0.1:0"), settle=False
    )
    assert router.parts.registration is not None
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(router.parts.registration.address)
    good = {
        "type": "D",
        "http_address": "127.0.0.1:9",
        "dp_size": 2,
        "tp_size": 1,
        "zmq_address": "host:127.0.0.1,handshake:9,notify:9",
        "transfer_mode": "READ",
    }
    bad = [
        b"\xc1 not msgpack",
        msgpack.packb([1, 2]),
        msgpack.packb({**good, "type": "X"}),
        msgpack.packb({**good, "transfer_mode": "BOGUS", "dp_size": None}),
        msgpack.packb({**good, "dp_size": float("inf")}),
        msgpack.packb({**good, "dp_size": 2_000_000}),
    ]
    try:
        for frame in bad:
            await sock.send(frame)
        await sock.send(msgpack.packb(good))
        for _ in range(100):
            if router.registry.workers:
                break
            await asyncio.sleep(0.02)
    finally:
        sock.close(0)
        ctx.term()
    (worker,) = router.registry.workers.values()
    assert (worker.role, worker.ranks, worker.transfer_mode) == ("decode", 2, "READ")


async def test_a_failing_prefill_rank_is_taken_out_by_its_breaker(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    dep = await deploy(
        start_cluster,
        start_router,
        "sglang",
        (1, 4),
        (1, 2),
        faults=Faults(failing_ranks=frozenset({1})),
        breaker_failures=2,
        breaker_cooldown=60,
    )
    pairs = await served(http, dep.router.url, 16)  # every one answered: the pair re-chosen
    assert "p0/1" not in {p for p, _ in pairs}
    pool = dep.router.registry.snapshot.pool("prefill")
    assert [t.label for t in pool] == ["p0/0", "p0/2", "p0/3"]
    async with http.get(dep.router.url + "/metrics") as r:
        text = await r.text()
    assert 'cause="status_500",dp_rank="1",role="prefill",worker="p0"} 2.0' in text


async def test_a_client_leaving_an_sglang_pd_request_aborts_both_legs(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    dep = await deploy(start_cluster, start_router, "sglang", (1, 2), (1, 2))
    (prefill,), (decode,) = dep.prefills, dep.decodes
    body = {"prompt": "a long story", "max_tokens": 5000}
    leaving = asyncio.create_task(http.post(dep.router.url + "/v1/completions", json=body))
    assert await until(lambda: any(r.num_running for r in decode.engine.ranks))
    leaving.cancel()
    assert await until(lambda: len(decode.abort_requests) == 1 == len(prefill.abort_requests))
    rid = decode.received[-1].body["rid"]
    assert prefill.received[-1].body["rid"] == rid  # one id for both legs
    assert list(decode.abort_requests) == list(prefill.abort_requests) == [rid]
    assert await until(lambda: not any(r.num_running for r in decode.engine.ranks))
    assert all(t.outstanding == 0 for t in dep.router.registry.targets())


async def test_a_decode_cutting_its_streams_short_is_taken_out_by_its_breaker(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    mode: PdMode = "vllm-nixl"
    cluster = await start_cluster([engine(mode, "prefill", 2), engine(mode, "decode", 1)])
    prefill, good = cluster.servers
    cutting = CutsStreams(PIECES[0])  # the decode engine dies mid-stream
    app = completions_engine(cutting.answer)
    async with serving(app) as url:
        router = await start_router(
            RouterConfig(
                pd=mode,
                workers=(
                    WorkerSpec(prefill.url, role="prefill"),
                    WorkerSpec(url, role="decode", dialect="vllm", dp_size=1),
                    WorkerSpec(good.url, role="decode"),
                ),
                breaker_failures=2,
                breaker_cooldown=60,
            )
        )
        ends = await stream_ends(http, router.url, PROMPT, 12)
    assert cutting.cuts == 2 and ends == {"cut": 2, "whole": 10}
    assert [t.worker.url for t in router.registry.snapshot.pool("decode")] == [good.url]
    assert len(router.registry.snapshot.pool("prefill")) == 2  # the prefills did nothing wrong


@pytest.mark.parametrize("mode", ["vllm-nixl", "sglang"])
async def test_a_hanging_prefill_is_passed_over_after_the_first_byte_timeout(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    mode: PdMode,
) -> None:
    dep = await deploy(
        start_cluster,
        start_router,
        mode,
        (2, 1),
        (1, 2),
        faults=Faults(hang=True),  # p0 accepts and never answers
        # short, to pass p0 over quickly; not so short that a busy machine's decode leg
        # misses it (0.3 s did once, in a whole-suite CI run)
        first_byte_timeout=1.0,
        breaker_failures=2,
        breaker_cooldown=60,
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    pairs = await served(http, dep.router.url, 6)
    assert {p for p, _ in pairs} == {"p1"}  # every request answered, by the other prefill
    assert loop.time() - started < 5  # not held until --read-timeout (600 s)
    async with http.get(dep.router.url + "/metrics") as r:
        text = await r.text()
    assert 'cause="no_answer",dp_rank="",role="prefill",worker="p0"} 2.0' in text  # then out


async def test_a_decode_leg_whose_connection_does_not_open_in_time_goes_again(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The only decode target stops accepting for a moment: its connect times out, the leg
    never left, so the pair is tried again with the same decode, which answers once."""
    (prefill,) = (await start_cluster([engine("vllm-nixl", "prefill", 2)])).servers
    seen: list[dict[str, Any]] = []

    async def decode(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"choices": [{"text": "decoded"}]})

    async with stalling(completions_engine(decode)) as stalled:
        router = await start_router(
            RouterConfig(
                pd="vllm-nixl",
                workers=(
                    WorkerSpec(prefill.url, role="prefill"),
                    WorkerSpec(stalled.url, role="decode", dialect="vllm", dp_size=1),
                ),
                connect_timeout=0.5,
                retry_backoff=0.6,
            )
        )
        await stalled.stall(0.6)
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200, await r.text()
        assert len(seen) == 1
        text = await (await http.get(router.url + "/metrics")).text()
        assert 'cause="connect_timeout",dp_rank="",role="decode",worker="d0"} 1.0' in text


@pytest.mark.parametrize("mode", ["sglang", "vllm-nixl"])
async def test_a_trusted_clients_ranks_pick_the_pair(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    mode: PdMode,
) -> None:
    """``--trust-client-rank`` under P/D: the client's rank picks the decode target and
    ``disagg_prefill_dp_rank`` the prefill target; untrusted, both are the router's choice."""
    dep = await deploy(start_cluster, start_router, mode, (1, 4), (1, 4), trust_client_rank=True)
    body = {**PROMPT, "routed_dp_rank": 2, "disagg_prefill_dp_rank": 3}
    for _ in range(3):
        async with http.post(dep.router.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert (r.headers["x-dprouter-prefill"], r.headers["x-dprouter-target"]) == (
                "p0/3",
                "d0/2",
            )
    assert [rec.rank for rec in dep.prefills[0].received] == [3] * 3
    assert [rec.rank for rec in dep.decodes[0].received] == [2] * 3
    async with http.post(
        dep.router.url + "/v1/completions", json={**body, "routed_dp_rank": 7}
    ) as r:
        assert r.status == 400
        assert (await r.json())["error"]["message"] == "no decode target has dp_rank 7"
    untrusted = await start_router(
        RouterConfig(
            pd=mode,
            workers=(
                WorkerSpec(dep.prefills[0].url, role="prefill"),
                WorkerSpec(dep.decodes[0].url, role="decode"),
            ),
        )
    )
    pairs = []
    for _ in range(4):
        async with http.post(untrusted.url + "/v1/completions", json=body) as r:
            pairs.append((r.headers["x-dprouter-prefill"], r.headers["x-dprouter-target"]))
    assert {p for p, _ in pairs} == {"p0/0", "p0/1", "p0/2", "p0/3"}


@pytest.mark.parametrize("mode", ["sglang", "vllm-nixl"])
async def test_a_trusted_rank_on_single_rank_workers_is_served_as_on_the_plain_path(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    mode: PdMode,
) -> None:
    """One pool rule for every path: a worker with one rank has a target with no rank,
    which serves whatever rank a trusted client pins (its engine has only that one).
    The P/D path had its own copy of the rule and answered 400 where the plain one
    passed."""
    dep = await deploy(start_cluster, start_router, mode, (1, 1), (1, 1), trust_client_rank=True)
    body = {**PROMPT, "routed_dp_rank": 0, "disagg_prefill_dp_rank": 0}
    async with http.post(dep.router.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert (r.headers["x-dprouter-prefill"], r.headers["x-dprouter-target"]) == ("p0", "d0")
    assert (len(dep.prefills[0].received), len(dep.decodes[0].received)) == (1, 1)
    (plain,) = (await start_cluster([EngineConfig(persona=dep.decodes[0].config.persona)])).servers
    router = await start_router(
        RouterConfig(workers=(WorkerSpec(plain.url),), trust_client_rank=True)
    )
    async with http.post(router.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["x-dprouter-target"] == "w0"


async def test_mooncake_decode_pulls_from_the_prefill_rank_that_ran(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The router makes the transfer id and names the engine of the rank it sent the
    prefill to, as the prefill's bootstrap server lists it; the simulated decode finds it
    there and pulls the KV (it fails the request otherwise)."""
    dep = await deploy(start_cluster, start_router, MOONCAKE, (1, 2), (1, 2))
    await served(http, dep.router.url, 8)
    prefill = dep.prefills[0]
    by_id = {rec.body["kv_transfer_params"]["transfer_id"]: rec for rec in prefill.received}
    assert len(by_id) == 8 and Counter(rec.rank for rec in prefill.received) == {0: 4, 1: 4}
    for rec in dep.decodes[0].received:
        kv = rec.body["kv_transfer_params"]
        ran = by_id[kv["transfer_id"]].rank
        assert kv["remote_engine_id"] == f"{prefill.engine_id}_dp{ran}"
        assert kv["remote_bootstrap_addr"] == f"http://127.0.0.1:{port(prefill)}"
        assert by_id[kv["transfer_id"]].body["ignore_eos"] is True


async def test_mooncake_engine_ids_are_asked_once_and_again_after_a_failure(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The engine ids are asked once and kept; a failed pair drops them (a restarted vLLM
    has new engine ids), so the next pair asks again."""
    configs = [engine(MOONCAKE, "prefill", 2, kv_wait=2.0)]
    configs += [engine(MOONCAKE, "decode", 1, kv_wait=2.0)] * 2
    configs[2] = replace(configs[2], faults=Faults(fail_rate=1.0))
    prefill, good, bad = (await start_cluster(configs)).servers
    specs = (
        WorkerSpec(prefill.url, role="prefill", bootstrap_port=port(prefill)),
        WorkerSpec(good.url, role="decode"),
    )
    router = await start_router(RouterConfig(pd=MOONCAKE, workers=specs))
    assert prefill.pd is not None
    await served(http, router.url, 1)
    assert prefill.pd.queries == 2  # the router and the decode asked, each once...
    assert all(await asyncio.gather(*(served(http, router.url, 1) for _ in range(6))))
    assert prefill.pd.queries == 2  # ...and neither again
    # another router, with a decode that fails every request: its pairs are retried on the
    # good decode, and each failure sends the next pair to ask the prefill again
    failing = await start_router(
        RouterConfig(pd=MOONCAKE, workers=(*specs, WorkerSpec(bad.url, role="decode")))
    )
    await served(http, failing.url, 4)
    assert bad.generation_requests >= 1
    assert prefill.pd.queries >= 2 + 1 + 1  # as before, this router, and once more


async def test_a_mooncake_prefill_whose_bootstrap_server_is_silent_is_passed_over(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    unused_tcp_port: int,
) -> None:
    configs = [engine(MOONCAKE, "prefill", 1), engine(MOONCAKE, "prefill", 1)]
    cluster = await start_cluster([*configs, engine(MOONCAKE, "decode", 1)])
    p0, p1, d = cluster.servers
    specs = (
        WorkerSpec(p0.url, role="prefill", bootstrap_port=unused_tcp_port),  # nobody there
        WorkerSpec(p1.url, role="prefill", bootstrap_port=port(p1)),
        WorkerSpec(d.url, role="decode"),
    )
    router = await start_router(RouterConfig(pd=MOONCAKE, workers=specs))
    pairs = await served(http, router.url, 4)
    assert {p for p, _ in pairs} == {"p1"}
    assert not p0.received  # never sent: its engine id could not be known
    errors = await metric_sum(http, router.url, "dprouter_upstream_errors_total")
    assert errors >= 1


async def test_a_body_read_as_json_goes_on_as_json_whatever_type_the_client_said(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """curl's default type is a form; a real SGLang refuses JSON sent as one ("Input should
    be a dictionary"), vLLM too (422). What the router read as JSON it sends as JSON: each
    P/D leg, a plain body with a rank written in, one it forwards untouched."""
    dep = await deploy(start_cluster, start_router, "sglang", (1, 2), (1, 2))
    engines = [EngineConfig(persona="sglang", dp_size=2), EngineConfig(persona="vllm")]
    sglang, vllm = (await start_cluster(engines)).servers
    plain = [await start_router(RouterConfig(workers=(WorkerSpec(s.url),))) for s in (sglang, vllm)]
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    raw = b'{"model": "sim-model", "prompt": "hello", "max_tokens": 2}'
    for url in (dep.router.url, *(r.url for r in plain)):
        async with http.post(url + "/v1/completions", data=raw, headers=form) as r:
            assert r.status == 200, await r.text()
    received = [*dep.prefills[0].received, *dep.decodes[0].received]
    received += [*sglang.received, *vllm.received]
    assert len(received) == 4
    assert {rec.headers["Content-Type"] for rec in received} == {"application/json"}
