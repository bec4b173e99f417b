"""LoRA adapter commands fanned out through the router to engines that differ (both
personas): the answer's status says what happened, beside each engine's row."""

from __future__ import annotations

import aiohttp
import pytest

from tests.conftest import StartCluster, StartRouter
from tests.test_lora_lists import LOAD, by_url
from tests.test_lora_routing import PERSONAS, P, engines, router_config


@pytest.mark.parametrize("persona", PERSONAS)
async def test_a_partial_fan_out_says_what_it_did(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    persona: str,
) -> None:
    """An unload through the router where one engine had the adapter and one did not:
    every engine that had it unloaded it, so 200 with each engine's row (before: 502
    upstream_error); again, when none has it: 404. A load where one engine has the name
    already: that engine's refusal is the client's to fix (400), the other's load said."""
    servers = (await start_cluster(engines(persona, ()))).servers
    router = await start_router(router_config(servers, models_interval=0))
    without, with_ = by_url(router, servers[0]), by_url(router, servers[1])
    load = LOAD[persona]
    step = {"lora_name": P, "lora_path": "/adapters/sql/step-4"}
    async with http.post(f"{router.url}{load}?worker={with_.id}", json=step) as r:
        assert r.status == 200, await r.text()
    unload = load.replace("load", "unload")
    async with http.post(router.url + unload, json={"lora_name": P}) as r:
        answer = await r.json()
        assert r.status == 200, answer
    assert (answer["unloaded"], answer["not_loaded"]) == ([with_.id], [without.id])
    statuses = {row["worker"]: row["status"] for row in answer["workers"]}
    assert statuses == {with_.id: 200, without.id: 404 if persona == "vllm" else 400}
    assert all(P not in row["models"] for row in answer["workers"])
    async with http.post(router.url + unload, json={"lora_name": P}) as r:
        answer = await r.json()
        assert r.status == 404 and "none of the 2" in answer["error"]["message"], answer
    async with http.post(f"{router.url}{load}?worker={with_.id}", json=step) as r:
        assert r.status == 200
    async with http.post(router.url + load, json=step) as r:
        answer = await r.json()
        assert r.status == 400, answer
    assert answer["loaded"] == [without.id]
    message = answer["error"]["message"]
    assert f"loaded on {without.id}" in message and f"failed on {with_.id} (400)" in message
    assert P in without.models and P in with_.models
