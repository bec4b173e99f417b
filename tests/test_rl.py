"""dprouter under an RL framework: registration in the SGLang gateway's shapes, engine
commands fanned out once per engine, routing that knows pauses and weights' versions.
Simulated engines (both personas) stand in; what each engine received is checked."""

from __future__ import annotations

import asyncio
import signal
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.fleet.weights import newest
from dprouter.server.commands import COMMANDS
from dprouter.server.router import Router
from dprouter.server.trust import Trust
from dprouter.sim.http.cluster import SimCluster
from dprouter.sim.model.config import EngineConfig, PdConfig
from tests.conftest import StartCluster, StartRouter, metric_sum, until, workers
from tests.test_cli import _serve, listening

SGLANG_DP = EngineConfig(persona="sglang", dp_size=2, dp_attention=True)
SLOW = {"max_tokens": 400}  # long enough to be in flight across a pause


async def generate(
    http: aiohttp.ClientSession,
    url: str,
    rid: str,
    headers: dict[str, str] | None = None,
    max_tokens: int = 4,
) -> tuple[int, dict[str, str], Any]:
    body = {"text": f"rollout {rid}", "rid": rid, "sampling_params": {"max_new_tokens": max_tokens}}
    async with http.post(url + "/generate", json=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def slow_loads(
    start_cluster: StartCluster, start_router: StartRouter, seconds: float
) -> tuple[SimCluster, Router]:
    """Two SGLang engines whose every weight load takes ``seconds``, behind a router."""
    cluster = await start_cluster([SGLANG_DP, SGLANG_DP])
    for server in cluster.servers:
        server.weights.update_time = seconds
    return cluster, await start_router(RouterConfig(workers=workers(*cluster.urls)))


async def test_miles_calls_succeed_against_a_router_started_as_a_framework_starts_it(
    start_cluster: StartCluster, http: aiohttp.ClientSession
) -> None:
    """Every call miles makes, in its order, to a router with no token and no worker."""
    cluster = await start_cluster([SGLANG_DP, SGLANG_DP, SGLANG_DP])
    proc = await _serve("--policy", "manual", "--assignment", "min_load")
    try:
        url, _ = await listening(proc)
        assert proc.stderr is not None
        said = [(await asyncio.wait_for(proc.stderr.readline(), 10)).decode() for _ in range(2)]
        assert "no admin credential: the admin API" in said[0]
        assert "on loopback, this host's own addresses (" in said[0]
        assert "no worker yet" in said[1]
        await miles(http, cluster, url)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def miles(http: aiohttp.ClientSession, cluster: SimCluster, url: str) -> None:
    one, two, old = cluster.urls
    # register each engine (current gateways), and one as routers <= 0.2.1 are asked
    for engine in (one, two):
        body = {"url": engine, "worker_type": "regular", "bootstrap_port": None}
        async with http.post(url + "/workers?wait=5", json=body) as r:
            assert r.status == 201, await r.text()
            assert (await r.json())["worker_type"] == "regular"
    async with http.post(url + "/add_worker", params={"url": old, "wait": "5"}) as r:
        assert r.status == 201, await r.text()
    async with http.get(url + "/workers") as r:
        listed = await r.json()
    assert [w["url"] for w in listed["workers"]] == [one, two, old]
    assert {w["id"] for w in listed["workers"]} == {"w0", "w1", "w2"}
    assert all(w["is_healthy"] and w["dp_size"] == 2 for w in listed["workers"])
    assert listed["total"] == 3 and listed["stats"]["by_type"]["regular"] == 3
    async with http.get(url + "/list_workers") as r:
        assert (await r.json()) == {"urls": [one, two, old]}
    # sessions: one key, one target, whichever connection carries it
    targets = set()
    for turn in range(3):
        status, headers, _ = await generate(
            http, url, f"s1-{turn}", {"X-SMG-Routing-Key": "session-1"}
        )
        assert status == 200
        targets.add(headers["x-dprouter-target"])
    assert len(targets) == 1
    # abort an over-sampled batch: through the listing, each engine, as miles does
    batch = [
        asyncio.create_task(generate(http, url, f"over-{i}", max_tokens=3000)) for i in range(6)
    ]
    assert await until(lambda: sum(s.runner.live() for s in cluster.servers) == 6)
    async with http.get(url + "/workers") as r:
        engines = [w["url"].split("@")[0] for w in (await r.json())["workers"]]
    for engine in engines:
        async with http.post(engine + "/abort_request", json={"abort_all": True}) as r:
            assert r.status == 200
    finished = await asyncio.wait_for(asyncio.gather(*batch), 10)
    assert all(status == 499 for status, _, _ in finished)  # each told, none hangs
    # the same through the router: one call, every engine
    async with http.post(url + "/abort_request", json={"abort_all": True}) as r:
        assert r.status == 200 and len((await r.json())["workers"]) == 3
    # one weight update, in miles' order
    steps: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/pause_generation", {"mode": "retract"}),
        ("GET", "/flush_cache", None),
        ("POST", "/begin_weight_update", {}),
        ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1"}),
        ("POST", "/update_weights_from_distributed", {"names": ["w"], "dtypes": ["bf16"]}),
        ("POST", "/update_weight_version", {"new_version": "2", "abort_all_requests": False}),
        ("POST", "/end_weight_update", {}),
        ("POST", "/continue_generation", {}),
        ("GET", "/v1/loads?include=core", None),
    ]
    for method, path, payload in steps:
        async with http.request(method, url + path, json=payload) as r:
            answer: dict[str, Any] = await r.json()
            assert r.status == 200, (path, answer)
            assert [row["status"] for row in answer["workers"]] == [200, 200, 200], path
    for server in cluster.servers:
        assert server.hits["POST /pause_generation"] == 1 and server.hits["GET /flush_cache"] == 1
        assert server.weights.version == "2" and server.weights.paused is None
    assert len(answer["loads"]) == 6  # every rank of every engine
    status, headers, meta = await generate(http, url, "after")
    assert status == 200 and headers["x-dprouter-weight-version"] == "2"
    assert meta["meta_info"]["weight_version"] == "2"
    # remove at shutdown: the id from the listing, then DELETE; older routers by URL
    async with http.get(url + "/workers") as r:
        ids = {w["url"]: w["id"] for w in (await r.json())["workers"]}
    async with http.delete(url + f"/workers/{ids[one]}") as r:
        assert r.status == 200
    async with http.delete(url + "/workers/" + quote(two, safe="")) as r:
        assert r.status == 200 and (await r.json())["url"] == two  # 0.2.x: by URL
    async with http.post(url + "/remove_worker", params={"url": old}) as r:
        assert r.status == 200
    async with http.get(url + "/list_workers") as r:
        assert (await r.json()) == {"urls": []}


async def test_a_pause_holds_new_requests_and_loses_none_in_flight(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Retract: in-flight requests stay in the engine; new ones wait in the router; all
    finish after the update, those that start after it on the new weights."""
    cluster = await start_cluster([EngineConfig(persona="sglang", dp_size=2, time_scale=0.05)])
    (engine,) = cluster.servers
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    url = router.url
    early = [
        asyncio.create_task(generate(http, url, f"early-{i}", max_tokens=60)) for i in range(4)
    ]
    assert await until(lambda: engine.runner.live() == 4)
    async with http.post(url + "/pause_generation", json={"mode": "retract"}) as r:
        assert r.status == 200
    (worker,) = router.registry.workers.values()
    assert worker.held == "paused" and not router.registry.snapshot.workers
    late = [asyncio.create_task(generate(http, url, f"late-{i}")) for i in range(4)]
    await asyncio.sleep(0.3)
    assert engine.runner.live() == 4 and not any(t.done() for t in early + late)
    assert not [r for r in engine.received if r.body.get("rid", "").startswith("late")]
    for method, path, body in (
        ("GET", "/flush_cache", None),
        ("POST", "/update_weights_from_disk", {"model_path": "m", "weight_version": "7"}),
        ("POST", "/continue_generation", {}),
    ):
        async with http.request(method, url + path, json=body) as r:
            assert r.status == 200, await r.text()
    done = await asyncio.wait_for(asyncio.gather(*early, *late), 20)
    assert [status for status, _, _ in done] == [200] * 8
    # those that waited were not refused: nothing counted as such
    assert await metric_sum(http, url, "dprouter_rejected_total") == 0
    assert engine.weights.retracted == 4
    assert {h["x-dprouter-weight-version"] for _, h, _ in done[4:]} == {"7"}
    assert worker.held is None and worker.weight_version == "7"


async def test_a_paused_worker_gets_no_new_request_while_another_can_serve(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([SGLANG_DP, SGLANG_DP])
    paused, serving = cluster.servers
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    async with http.post(
        router.url + "/pause_generation?worker=w0", json={"mode": "in_place"}
    ) as r:
        rows = (await r.json())["workers"]
        assert r.status == 200 and [row["worker"] for row in rows] == ["w0"]
    done = await asyncio.gather(*(generate(http, router.url, f"r{i}") for i in range(8)))
    assert [status for status, _, _ in done] == [200] * 8
    assert {h["x-dprouter-target"].split("/")[0] for _, h, _ in done} == {"w1"}
    assert not paused.received and len(serving.received) == 8
    async with http.get(router.url + "/v1/rl/workers") as r:
        listing = await r.json()
    held = {w["id"]: w["held"] for w in listing["workers"]}
    assert held == {"w0": "paused", "w1": None}
    assert listing["workers"][0]["capabilities"]["pause_modes"] == ["abort", "retract", "in_place"]
    async with http.post(router.url + "/continue_generation", json={}) as r:
        assert r.status == 200
    assert router.registry.workers["w0"].held is None


async def test_a_weight_update_is_one_at_a_time_and_a_second_gets_409(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster, router = await slow_loads(start_cluster, start_router, 0.5)
    body = {"model_path": "m", "weight_version": "3"}
    first = asyncio.create_task(http.post(router.url + "/update_weights_from_disk", json=body))
    assert await until(lambda: router.registry.workers["w0"].held == "updating its weights")
    async with http.post(router.url + "/update_weights_from_disk", json=body) as r:
        assert r.status == 409 and "one at a time" in (await r.json())["error"]["message"]
    async with http.post(router.url + "/update_weight_version", json={"new_version": "3"}) as r:
        assert r.status == 409
    async with await first as r:
        assert r.status == 200
    assert [s.weights.updates for s in cluster.servers] == [1, 1]
    assert {w.weight_version for w in router.registry.workers.values()} == {"3"}
    async with http.post(router.url + "/update_weight_version", json={"new_version": "4"}) as r:
        assert r.status == 200


async def test_a_command_that_fails_anywhere_answers_with_every_worker_detail(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([SGLANG_DP, SGLANG_DP])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    # every engine refuses it alike (no model_path): the client's to fix, with their words
    async with http.post(router.url + "/update_weights_from_disk", json={}) as r:
        answer = await r.json()
    assert r.status == 422 and "failed on 2 of 2" in answer["error"]["message"]
    assert [row["status"] for row in answer["workers"]] == [422, 422]
    assert answer["workers"][0]["body"]["detail"][0]["loc"] == ["body", "model_path"]
    assert {w.weight_version for w in router.registry.workers.values()} == {"default"}
    # one engine gone: the others did it, and the answer says which did not
    await cluster.servers[1].crash()
    async with http.post(router.url + "/update_weight_version", json={"new_version": "5"}) as r:
        answer = await r.json()
    assert r.status == 502
    rows = {row["worker"]: row for row in answer["workers"]}
    assert rows["w0"]["status"] == 200 and rows["w1"]["status"] is None
    assert rows["w1"]["error"] and "w1" in answer["error"]["message"]
    assert router.registry.workers["w0"].weight_version == "5"
    assert router.registry.workers["w1"].weight_version == "default"
    async with http.post(router.url + "/update_weights_from_disk", data=b"{no") as r:
        assert r.status == 400


async def test_a_request_may_ask_for_weights_and_waits_for_them(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([SGLANG_DP, SGLANG_DP])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), hold_wait=5))
    url = router.url
    async with http.post(url + "/update_weight_version?worker=w1", json={"new_version": "8"}) as r:
        assert r.status == 200
    # latest: only w1 serves 8; at least 8 likewise; at least 2 either
    for asked, served in (("latest", {"w1"}), (">=8", {"w1"}), ("8", {"w1"})):
        done = await asyncio.gather(
            *(
                generate(http, url, f"{asked}{i}", {"X-DPRouter-Weight-Version": asked})
                for i in range(4)
            )
        )
        assert {h["x-dprouter-target"].split("/")[0] for _, h, _ in done} == served, asked
        assert {h["x-dprouter-weight-version"] for _, h, _ in done} == {"8"}
    # newer than any: it waits, and goes once an engine has it
    waiting = asyncio.create_task(generate(http, url, "nine", {"X-DPRouter-Weight-Version": ">=9"}))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    async with http.post(url + "/update_weight_version?worker=w0", json={"new_version": "9"}) as r:
        assert r.status == 200
    status, headers, _ = await asyncio.wait_for(waiting, 5)
    assert status == 200 and headers["x-dprouter-weight-version"] == "9"
    async with http.post(
        url + "/generate", json={"text": "x"}, headers={"X-DPRouter-Weight-Version": ">="}
    ) as r:
        assert r.status == 400


async def test_a_bounded_wait_ends_in_a_clear_503(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([SGLANG_DP])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), hold_wait=0.3))
    async with http.post(router.url + "/pause_generation", json={"mode": "abort"}) as r:
        assert r.status == 200
    status, _, answer = await generate(http, router.url, "x")
    assert status == 503 and "paused; waited 0.3 s" in answer["error"]["message"]
    assert not cluster.servers[0].received


@pytest.mark.parametrize("persona", ["sglang", "vllm"])
async def test_every_command_reaches_each_engine_once_under_its_own_name(
    persona: str,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """One call per engine (not per rank), under the engine's own path and method."""
    cluster = await start_cluster([EngineConfig(persona=persona, dp_size=2)] * 2)  # type: ignore[arg-type]
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    bodies: dict[str, dict[str, Any]] = {
        "/update_weights_from_disk": {"model_path": "m"},
        "/update_weight_version": {"new_version": "1"},
        "/pause_generation": {"mode": "retract"},
        "/abort_request": {"abort_all": True},
        "/pause": {},
        # loaded, unloaded, then again under vLLM's own names
        "/load_lora_adapter": {"lora_name": "a", "lora_path": "/adapters/a"},
        "/unload_lora_adapter": {"lora_name": "a"},
        "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/adapters/a"},
        "/v1/unload_lora_adapter": {"lora_name": "a"},
    }
    sent = 0
    for command in COMMANDS:
        call = command.calls.get(persona)  # type: ignore[call-overload]
        if call is None:
            continue
        method = command.methods[-1]
        async with http.request(
            method, router.url + command.path, json=bodies.get(command.path, {})
        ) as r:
            answer = await r.json()
            assert r.status == 200, (command.path, answer)
        sent += 1
        hit = f"{call.method or method} {call.path}"
        for server in cluster.servers:
            assert server.hits[hit] >= 1, (command.path, hit)
        assert len(answer["workers"]) == 2
        if command.effect == "pause":  # the next command must not find it paused
            async with http.post(router.url + "/continue_generation", json={}) as r:
                assert r.status == 200
    assert sent >= (18 if persona == "sglang" else 21)
    # SGLang's pause mode in vLLM's words
    if persona == "vllm":
        async with http.post(router.url + "/pause_generation", json={"mode": "retract"}) as r:
            assert r.status == 200
        assert all(s.weights.paused == "keep" for s in cluster.servers)
        async with http.post(router.url + "/continue_generation", json={}) as r:
            assert r.status == 200
        assert all(s.weights.paused is None for s in cluster.servers)


async def test_smgs_rl_fan_out_paths_run_the_same_commands(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A framework written for smg's ``--enable-rl`` (``/v1/rl/engine/{path}?selector=``)
    gets the same commands, holds and versions, in smg's answer shape."""
    cluster = await start_cluster([SGLANG_DP, SGLANG_DP])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    url = router.url + "/v1/rl/engine"
    async with http.post(
        url + "/pause_generation?selector=worker_type=regular", json={"mode": "retract"}
    ) as r:
        answer = await r.json()
    assert r.status == 200 and (answer["total"], answer["succeeded"], answer["failed"]) == (
        2,
        2,
        [],
    )
    assert answer["results"]["w0"]["body"]["status"] == "ok"
    assert all(s.weights.paused == "retract" for s in cluster.servers)
    assert {w.held for w in router.registry.workers.values()} == {"paused"}
    async with http.post(url + "/continue_generation?selector=id=w1", json={}) as r:
        assert r.status == 200 and list((await r.json())["results"]) == ["w1"]
    assert [s.weights.paused for s in cluster.servers] == ["retract", None]
    path = router.url + "/v1/rl/workers/w0/engine/continue_generation"
    async with http.post(path, json={}) as r:
        single = await r.json()
    assert r.status == 200 and single["worker_id"] == "w0" and single["status"] == 200
    assert {w.held for w in router.registry.workers.values()} == {None}
    async with http.post(url + "/pause_generation?selector=nope", json={}) as r:
        assert r.status == 400
    async with http.post(url + "/pause_generation?selector=engine=vllm", json={}) as r:
        assert r.status == 404
    async with http.post(url + "/collective_rpc?selector=engine=sglang", json={}) as r:
        assert r.status == 404  # not an engine command: never passed on


async def test_pd_engines_register_by_worker_type_and_join_their_pools(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """miles registers a P/D fleet with worker_type (and the prefill's bootstrap_port)."""
    roles = [PdConfig(mode="sglang", role=role, kv_wait=2.0) for role in ("prefill", "decode")]
    cluster = await start_cluster(
        [EngineConfig(persona="sglang", dp_size=2, pd=pd) for pd in roles]
    )
    prefill, decode = cluster.servers
    router = await start_router(RouterConfig(pd="sglang"), settle=False)
    port = prefill.pd.bootstrap_port if prefill.pd is not None else None
    for body in (
        {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": port},
        {"url": decode.url, "worker_type": "decode"},
    ):
        async with http.post(router.url + "/workers?wait=5", json=body) as r:
            assert r.status == 201, await r.text()
    async with http.post(router.url + "/workers", json={"url": "http://127.0.0.1:9"}) as r:
        assert r.status == 400  # a regular worker has no place in a P/D router
    async with http.get(router.url + "/workers") as r:
        listed = await r.json()
    assert [w["worker_type"] for w in listed["workers"]] == ["prefill", "decode"]
    assert listed["stats"]["by_type"] == {"regular": 0, "prefill": 1, "decode": 1}
    assert listed["workers"][0]["bootstrap_port"] == port
    status, headers, _ = await generate(http, router.url, "pd-1")
    assert status == 200 and headers["x-dprouter-prefill"].startswith("p0/")
    assert len(decode.received) == 1


async def test_a_command_runs_to_its_end_when_its_client_leaves(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster, router = await slow_loads(start_cluster, start_router, 0.5)
    body = {"model_path": "m", "weight_version": "11"}
    quick = aiohttp.ClientTimeout(total=0.1)
    with pytest.raises(TimeoutError):
        await http.post(router.url + "/update_weights_from_disk", json=body, timeout=quick)
    assert await until(lambda: all(s.weights.updates == 1 for s in cluster.servers))
    listed = router.registry.workers.values()
    assert await until(lambda: all(w.held is None and w.weight_version == "11" for w in listed))
    async with http.get(router.url + "/v1/rl/workers") as r:
        assert (await r.json())["updates"] == {}  # the lock went with it


async def test_updates_to_different_workers_run_side_by_side(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """miles sends init_weights_update_group to each engine with its own rank_offset, at
    once: the lock is per worker, and a fleet-wide update meanwhile is refused."""
    _, router = await slow_loads(start_cluster, start_router, 0.4)

    async def update(worker: str) -> int:
        body = {"model_path": "m", "weight_version": "2"}
        path = f"/update_weights_from_disk?worker={worker}"
        async with http.post(router.url + path, json=body) as r:
            return r.status

    both = asyncio.gather(update("w0"), update("w1"))
    assert await until(lambda: all(w.held for w in router.registry.workers.values()))
    async with http.post(router.url + "/update_weight_version", json={"new_version": "3"}) as r:
        assert r.status == 409 and "on w0" in (await r.json())["error"]["message"]
    assert list(await both) == [200, 200]


def test_latest_is_the_largest_number_and_a_mapped_loopback_is_loopback() -> None:
    assert newest(["7", "default"]) == "7" and newest(["default", "7", "12"]) == "12"
    assert newest(["a", "b"]) == "b" and newest([None]) is None
    assert Trust(()).trusts("::ffff:127.0.0.1")
    assert Trust(("203.0.113.0/24",)).trusts("::ffff:203.0.113.4")
