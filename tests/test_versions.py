"""Weights' versions that stay true when a framework updates the engines straight, not
through the router (miles sends ``update_weight_version`` to each engine itself): the
router learns the version from the answers that state it (SGLang's), reads it when a
request waits for weights, and reads it every ``--version-interval`` for idle workers.
Simulated engines of both personas stand in; each update goes to the engine directly."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.fleet.weights import stated
from dprouter.sim.model.config import EngineConfig, Persona
from tests.conftest import StartCluster, StartProcesses, StartRouter, until, workers

PINNED_WAIT = 30.0  # a pinned request that waited for the periodic read would show it


async def bump(http: aiohttp.ClientSession, engine: str, version: str) -> None:
    """The engine's own update_weight_version (same path and body in both engines)."""
    async with http.post(engine + "/update_weight_version", json={"new_version": version}) as r:
        assert r.status == 200, await r.text()


async def listed(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/workers") as r:
        return {w["id"]: w["weight_version"] for w in (await r.json())["workers"]}


async def complete(
    http: aiohttp.ClientSession, url: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    body: dict[str, Any]
    if path == "/generate":
        body = {"text": "rollout", "sampling_params": {"max_new_tokens": 4}}
    else:
        body = {"model": "sim-model", "prompt": "rollout", "max_tokens": 4}
    async with http.post(url + path, json=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_an_sglang_answer_states_the_version_and_the_router_takes_it_at_once(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession, path: str
) -> None:
    """The issue's reproduction: an update straight to the engine, then a request through
    the router. The answer's header is the version the engine just stated, the router's
    listings follow, and a request pinned to it goes at once."""
    cluster = await start_cluster([EngineConfig(persona="sglang", dp_size=2)])
    config = RouterConfig(
        workers=workers(*cluster.urls), hold_wait=PINNED_WAIT, version_interval=0
    )  # no periodic read: the answer alone must teach it
    router = await start_router(config)
    assert await listed(http, router.url) == {"w0": "default"}
    await bump(http, cluster.urls[0], "7")
    status, headers, answer = await complete(http, router.url, path)
    assert status == 200
    said = answer["meta_info"] if path == "/generate" else answer["metadata"]
    assert said["weight_version"] == "7"
    assert headers["x-dprouter-weight-version"] == "7"
    assert await listed(http, router.url) == {"w0": "7"}
    async with http.get(router.url + "/v1/rl/workers") as r:
        assert [w["weight_version"] for w in (await r.json())["workers"]] == ["7"]
    pinned = complete(http, router.url, path, {"X-DPRouter-Weight-Version": ">=7"})
    status, headers, _ = await asyncio.wait_for(pinned, PINNED_WAIT / 3)
    assert status == 200 and headers["x-dprouter-weight-version"] == "7"


async def test_an_sglang_stream_teaches_the_version_from_its_first_event(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(persona="sglang")])
    config = RouterConfig(workers=workers(*cluster.urls), version_interval=0)
    router = await start_router(config)
    await bump(http, cluster.urls[0], "3")
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    async with http.post(router.url + "/generate", json=body) as r:
        assert r.status == 200
        text = await r.text()
    assert '"weight_version": "3"' in text or '"weight_version":"3"' in text
    assert await listed(http, router.url) == {"w0": "3"}


@pytest.mark.parametrize("persona", ["sglang", "vllm"])
async def test_a_pinned_request_does_not_wait_for_weights_the_engine_has(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    persona: Persona,
) -> None:
    """No answer in between to state it (vLLM's never do): the request that asks for the
    weights has the engines read, and goes to the one that has them."""
    dp = EngineConfig(persona=persona, dp_size=2)
    cluster = await start_cluster([dp, dp])
    config = RouterConfig(workers=workers(*cluster.urls), hold_wait=PINNED_WAIT, version_interval=0)
    router = await start_router(config)
    before = await listed(http, router.url)
    await bump(http, cluster.urls[1], "12")
    path = "/generate" if persona == "sglang" else "/v1/completions"
    for _ in range(4):
        pinned = complete(http, router.url, path, {"X-DPRouter-Weight-Version": ">=12"})
        status, headers, _ = await asyncio.wait_for(pinned, PINNED_WAIT / 3)
        assert status == 200
        assert headers["x-dprouter-target"].startswith("w1")
        assert headers["x-dprouter-weight-version"] == "12"
    assert await listed(http, router.url) == {**before, "w1": "12"}


@pytest.mark.parametrize("persona", ["sglang", "vllm"])
async def test_idle_workers_versions_are_read_within_the_interval(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    persona: Persona,
) -> None:
    cluster = await start_cluster([EngineConfig(persona=persona)])
    router = await start_router(RouterConfig(workers=workers(*cluster.urls), version_interval=0.2))
    await bump(http, cluster.urls[0], "5")
    got: dict[str, Any] = {}

    async def read() -> bool:
        got.update(await listed(http, router.url))
        return got == {"w0": "5"}

    for _ in range(50):  # 5 s: 25 intervals
        if await read():
            break
        await asyncio.sleep(0.1)
    assert got == {"w0": "5"}
    assert not cluster.servers[0].received  # read, not learnt from a request


async def test_under_processes_a_stated_version_reaches_every_process(
    start_cluster: StartCluster, start_processes: StartProcesses, http: aiohttp.ClientSession
) -> None:
    """One serving process reads the version off an answer; the parent, and through it
    the other process, take it: every later answer carries it, whichever process."""
    cluster = await start_cluster([EngineConfig(persona="sglang", dp_size=2)])
    config = RouterConfig(workers=workers(*cluster.urls), version_interval=0)
    sup = await start_processes(config)
    await bump(http, cluster.urls[0], "4")
    status, headers, _ = await complete(http, sup.url, "/generate")
    assert status == 200 and headers["x-dprouter-weight-version"] == "4"
    assert await until(lambda: sup.registry.workers["w0"].weight_version == "4")
    # many connections: both processes serve some, and each stamps the new version
    async with aiohttp.ClientSession() as fresh:
        done = await asyncio.gather(
            *(
                complete(fresh, sup.url, "/v1/completions", {"Connection": "close"})
                for _ in range(16)
            )
        )
    assert {h["x-dprouter-weight-version"] for _, h, _ in done} == {"4"}
    await bump(http, cluster.urls[0], "5")  # no answer says it: a pinned request reads
    pinned = complete(http, sup.url, "/generate", {"X-DPRouter-Weight-Version": ">=5"})
    status, headers, _ = await asyncio.wait_for(pinned, 10)
    assert status == 200 and headers["x-dprouter-weight-version"] == "5"


def test_an_answer_made_before_the_routers_last_change_does_not_undo_it() -> None:
    """A request sent before an update the router relayed may answer after it, stating
    the old version: that answer must not turn the worker back."""
    registry = Registry()
    worker = registry.add(Worker(id="w0", url="http://127.0.0.1:1", dialect="sglang"))
    monitor = Monitor(registry)
    sent_before = 0.0
    registry.set_weight_version(worker, "8")
    monitor.stated(worker, "7", sent_before)
    assert worker.weight_version == "8"
    monitor.stated(worker, "9", worker.version_since + 1.0)  # sent after: the engine's word
    assert worker.weight_version == "9"


def test_the_stated_version_is_the_fields_not_generated_text() -> None:
    text = b'{"text": "say \\"weight_version\\": \\"99\\"", "meta_info": {"weight_version": "7"}}'
    assert stated(text) == "7"
    assert stated(b'{"metadata": {"weight_version": "default"}}') == "default"
    assert stated(b'{"choices": [{"text": "no version here"}]}') is None


async def test_the_version_interval_is_validated() -> None:
    from dprouter.config import validate
    from dprouter.core.errors import ConfigError

    with pytest.raises(ConfigError, match="version_interval"):
        validate(replace(RouterConfig(), version_interval=-1))
