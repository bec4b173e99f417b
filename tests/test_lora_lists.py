"""Model lists that correct themselves: LoRA adapters loaded or unloaded straight at an
engine (not through the router), over two simulated engines of two DP ranks each, both
personas. The router reads every engine's /v1/models again every ``--models-interval``
seconds, and an engine's own "does not serve it" answer makes it read that engine's
list at once and send the request, once, to a worker that serves it."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from dprouter.core.headers import TARGET_HEADER
from dprouter.fleet.model_lists import served
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.multiproc.supervisor import Supervisor
from dprouter.server.router import Router
from dprouter.sim.http.server import SimServer
from tests.conftest import StartCluster, StartProcesses, StartRouter, metric_sum, until
from tests.test_lora_routing import PERSONAS, P, as_adapter, engines, router_config

LOAD = {"vllm": "/v1/load_lora_adapter", "sglang": "/load_lora_adapter"}


async def at_engine(
    http: aiohttp.ClientSession, server: SimServer, persona: str, path: str, body: Any
) -> None:
    """A command straight to the engine, as an RL framework or an operator sends it."""
    url = server.url + LOAD[persona].replace("load", path)
    async with http.post(url, json=body) as r:
        assert r.status == 200, await r.text()


async def ask(http: aiohttp.ClientSession, url: str, fields: dict[str, Any]) -> tuple[int, str]:
    """One short completion: its status, and the worker that answered (or the error)."""
    body = {**fields, "prompt": "hello there", "max_tokens": 2}
    async with http.post(url + "/v1/completions", json=body) as r:
        answer = await r.json()
        if r.status != 200:
            return r.status, str(answer)
        return r.status, r.headers[TARGET_HEADER].split("/")[0]


def by_url(router: Router | Supervisor, server: SimServer) -> Worker:
    return next(w for w in router.registry.workers.values() if w.url == server.url)


@pytest.mark.parametrize("persona", PERSONAS)
async def test_an_adapter_loaded_straight_at_an_engine_is_routed_there_within_the_bound(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    persona: str,
) -> None:
    """The issue's case: an adapter loaded at one engine was unknown to the router 203 s
    later. Now its list is read again within ``--models-interval``, and every request for
    the adapter goes to that engine."""
    servers = (await start_cluster(engines(persona, ()))).servers
    router = await start_router(router_config(servers, models_interval=0.5))
    loaded = {"lora_name": P, "lora_path": "/adapters/sql/step-3"}
    await at_engine(http, servers[1], persona, "load", loaded)
    worker = by_url(router, servers[1])
    assert await until(lambda: P in router.registry.snapshot.known_models, 5.0)
    assert router.registry.snapshot.pool("regular", as_adapter(persona, P)["model"])
    answers = [await ask(http, router.url, as_adapter(persona, P)) for _ in range(20)]
    assert answers == [(200, worker.id)] * 20
    await at_engine(http, servers[1], persona, "unload", {"lora_name": P})
    assert await until(lambda: P not in worker.models, 5.0)  # and gone, likewise


@pytest.mark.parametrize("persona", PERSONAS)
async def test_an_adapter_unloaded_straight_at_one_engine_is_served_by_the_other(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    persona: str,
) -> None:
    """The issue's case, with the periodic read off: unloaded at one of two engines, 10
    of 20 requests got that engine's 404. Now vLLM's "does not exist" makes the router
    read that engine's list and send the request to the other engine: 20 of 20 served,
    and from then on only there. SGLang loads an adapter it unloaded again when a request
    names it (its lora_ref_cache): served where it goes."""
    servers = (await start_cluster(engines(persona, (P,)))).servers
    router = await start_router(router_config(servers, models_interval=0, policy="round_robin"))
    dropped, kept = by_url(router, servers[0]), by_url(router, servers[1])
    await at_engine(http, servers[0], persona, "unload", {"lora_name": P})
    assert P in dropped.models  # the router has not heard
    answers = [await ask(http, router.url, as_adapter(persona, P)) for _ in range(20)]
    assert {status for status, _ in answers} == {200}, answers
    if persona == "vllm":
        assert {who for _, who in answers} == {kept.id}
        assert P not in dropped.models  # read again on its answer
        name = "dprouter_upstream_errors_total"
        refused = await metric_sum(http, router.url, name, worker=dropped.id, cause="not_served")
        assert refused >= 1  # it was asked, said no, and the request went on
    else:
        assert {who for _, who in answers} == {dropped.id, kept.id}


async def test_with_no_other_worker_the_engines_refusal_passes_and_the_list_is_mended(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """The retry rules' bound: no other worker to try (the other rank is the same
    engine), so the client hears the engine's own 404, not a 502; the router has read the
    list meanwhile, and the next request is its own 404."""
    (server, _) = (await start_cluster(engines("vllm", (P,)))).servers
    router = await start_router(router_config([server], models_interval=0))
    await at_engine(http, server, "vllm", "unload", {"lora_name": P})
    status, said = await ask(http, router.url, {"model": P})
    assert status == 404 and "Valid aliases" in said  # the engine's words
    assert await until(lambda: P not in router.registry.snapshot.known_models)
    status, said = await ask(http, router.url, {"model": P})
    assert status == 404 and "Valid aliases" not in said  # the router's own


async def test_serving_processes_have_the_parent_read_the_list_again(
    start_cluster: StartCluster, start_processes: StartProcesses, http: aiohttp.ClientSession
) -> None:
    """Under ``--processes 2`` the parent reads the lists (a serving process's own copy is
    overwritten by the parent's next state): an engine's refusal in either process sends
    it word, and both processes then route the adapter to the other engine only."""
    servers = (await start_cluster(engines("vllm", (P,)))).servers
    sup = await start_processes(router_config(servers, models_interval=0, policy="round_robin"))
    dropped = by_url(sup, servers[0])
    await at_engine(http, servers[0], "vllm", "unload", {"lora_name": P})
    answers = [await ask(http, sup.url, {"model": P}) for _ in range(20)]
    assert {status for status, _ in answers} == {200}, answers
    assert await until(lambda: P not in dropped.models)  # the parent's registry
    later = [await ask(http, sup.url, {"model": P}) for _ in range(8)]
    assert dropped.id not in {who for _, who in later}


def test_a_list_read_again_rebuilds_the_snapshot_only_when_it_changed() -> None:
    """vLLM's cards carry their read time and a random permission id: a list that says
    the same again rebuilds nothing (policies keep their per-pool state); one with an
    adapter more, or a parent changed, does."""
    registry = Registry()
    worker = registry.add(Worker("w0", "http://127.0.0.1:9", dialect="vllm"))
    worker.ranks = 2
    registry.mark_ready(worker)

    def card(name: str, parent: str | None, read: int) -> dict[str, Any]:
        permission = [{"id": f"modelperm-{read}{name}", "created": read}]
        return {"id": name, "parent": parent, "created": read, "permission": permission}

    assert served(registry, worker, [card("base", None, 1)])
    version = registry.snapshot.version
    assert not served(registry, worker, [card("base", None, 2)])
    assert registry.snapshot.version == version
    assert served(registry, worker, [card("base", None, 3), card(P, "base", 3)])
    assert registry.snapshot.pool("regular", P) and registry.snapshot.version > version
    assert served(registry, worker, [card("base", None, 4), card(P, "other", 4)])
