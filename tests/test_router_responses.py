"""The Responses API through the router: whatever names a stored response reaches the
worker that made it, and an id the router does not know is its own clear 404."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest

from dprouter.config import RouterConfig
from dprouter.proxy.response_ids import ResponseIds
from dprouter.sim.model.config import EngineConfig, Persona
from tests.conftest import StartCluster, StartRouter, workers


async def create(
    http: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[str, str, bytes]:
    """The new response's id, the target that made it, and the bytes the client got."""
    async with http.post(url + "/v1/responses", json=body) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
        target = r.headers["x-dprouter-target"]
    if body.get("stream"):
        first = raw.split(b"\n\n")[0].split(b"data: ", 1)[1]
        return orjson.loads(first)["response"]["id"], target, raw
    return orjson.loads(raw)["id"], target, raw


@pytest.mark.parametrize("persona", ["vllm", "sglang"])
async def test_fifty_follow_ups_in_a_row_each_reach_the_worker_that_stored_it(
    persona: Persona,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    cluster = await start_cluster([EngineConfig(persona=persona)] * 4)
    config = RouterConfig(workers=workers(*cluster.urls), policy="round_robin")
    router = await start_router(config)
    by_url = {s.url: s for s in cluster.servers}
    for _ in range(2):  # round robin moves on: the response is stored on a target but the first
        await create(http, router.url, {"input": "before", "model": "sim-model", "store": False})
    rid, made_by, _ = await create(http, router.url, {"input": "hello", "model": "sim-model"})
    assert made_by == "w2"  # a follow-up sent to the pool's first target would not find it
    for i in range(50):
        async with http.get(router.url + f"/v1/responses/{rid}") as r:
            assert r.status == 200
            assert (await r.json())["id"] == rid
            assert r.headers["x-dprouter-target"] == made_by
        body = {"input": f"turn {i}", "previous_response_id": rid, "stream": i % 2 == 1}
        new, target, _ = await create(http, router.url, body)
        assert target == made_by  # the policy alone would have gone round the four
        rid = new
    # every engine but one saw no follow-up, and that one never answered 404
    held = [s for s in by_url.values() if s.responses.kept]
    assert held == [cluster.servers[2]] and len(held[0].responses.kept) == 51
    # meanwhile new conversations went round all four
    seen = {(await create(http, router.url, {"input": "new"}))[1] for _ in range(4)}
    assert len(seen) == 4


async def test_a_stream_reaches_the_client_byte_for_byte_and_is_followed_up(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=2)] * 2)
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    for _ in range(3):  # round robin moves on: stored on the last of the four targets
        await create(http, router.url, {"input": "before", "store": False})
    rid, target, raw = await create(http, router.url, {"input": "stream me", "stream": True})
    assert target == "w1/1"
    engine = next(s for s in cluster.servers if rid in s.responses.kept)
    async with http.get(engine.url + f"/v1/responses/{rid}") as r:
        stored = await r.json()
    text = stored["output"][0]["content"][0]["text"]
    deltas = [line for line in raw.split(b"\n") if b"output_text.delta" in line]
    assert raw.startswith(b"event: response.created\n") and raw.endswith(b"\n\n")
    assert len(deltas) == 2 * len(text.split())  # an event line and a data line per word
    rank = int(target.split("/")[1])
    assert engine.responses.kept[rid].rank == rank  # the rank the router chose made it
    async with http.get(router.url + f"/v1/responses/{rid}") as r:
        assert r.status == 200 and r.headers["x-sim-dp-rank"] == str(rank)
        got = [g for g in engine.received if g.path == f"/v1/responses/{rid}"][-1]
        assert got.headers["X-data-parallel-rank"] == str(rank)


async def test_unknown_and_forgotten_ids_are_the_routers_own_404(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    for method, path in [("GET", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel")]:
        async with http.request(method, router.url + path) as r:
            assert r.status == 404
            error = (await r.json())["error"]
            assert "the router never routed it" in error["message"]
            assert error["type"] == "not_found_error" and error["param"] == "response_id"
    body = {"input": "hi", "previous_response_id": "resp_x"}
    async with http.post(router.url + "/v1/responses", json=body) as r:
        assert r.status == 404
    async with http.post(
        router.url + "/v1/responses", json={**body, "previous_response_id": 3}
    ) as r:
        assert r.status == 400
    assert not engine.received  # nothing reached the engine


async def test_a_background_response_is_cancelled_on_its_own_worker(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(persona="sglang")] * 3)
    config = RouterConfig(workers=workers(*cluster.urls), policy="round_robin")
    router = await start_router(config)
    body = {"input": "long", "background": True, "max_output_tokens": 3000}  # 300 s of work
    rid, made_by, _ = await create(http, router.url, body)
    async with http.get(router.url + f"/v1/responses/{rid}") as r:
        assert (await r.json())["status"] == "in_progress"
    async with http.post(router.url + f"/v1/responses/{rid}/cancel") as r:
        assert r.status == 200 and (await r.json())["status"] == "cancelled"
        assert r.headers["x-dprouter-target"] == made_by
    async with http.get(router.url + f"/v1/responses/{rid}") as r:
        assert (await r.json())["status"] == "cancelled"


def test_the_id_map_is_bounded_and_forgets_idle_ids() -> None:
    now = [0.0]
    kept = ResponseIds(size=3, ttl=10.0, clock=lambda: now[0])
    for i in range(4):
        kept.put(f"r{i}", f"w{i}")
    assert kept.get("r0") is None  # the oldest went first
    assert kept.get("r1") == "w1"
    now[0] = 9.0
    assert kept.get("r1") == "w1"  # in use: kept ten seconds more
    now[0] = 12.0
    assert kept.get("r2") is None and kept.get("r1") == "w1"


async def test_the_official_client_streams_a_response_through_the_router(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """``responses.stream()`` of the official client keeps a snapshot of the response as
    its events come, and needs each output item and content part announced before their
    text: the simulated engines' stream now has every event vLLM's has."""
    cluster = await start_cluster([EngineConfig(dp_size=2), EngineConfig(persona="sglang")])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls)))
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    try:
        for _ in range(3):  # both engines' personas
            kinds: list[str] = []
            deltas: list[str] = []
            async with client.responses.stream(model="sim-model", input="stream me") as stream:
                async for e in stream:
                    kinds.append(e.type)
                    if e.type == "response.output_text.delta":
                        deltas.append(e.delta)
                final = await stream.get_final_response()
            assert final.status == "completed" and final.output_text == "".join(deltas)
            assert kinds[:4] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
            ]
            assert kinds[-4:] == [
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
            async with http.get(router.url + f"/v1/responses/{final.id}") as r:  # kept there
                assert (await r.json())["output"][0]["content"][0]["text"] == final.output_text
    finally:
        await client.close()
