"""Workers from Kubernetes pods, against a stand-in API server on loopback.

Each pod of the stand-in points its IP at 127.0.0.1 and its ports (the
``dprouter/ports`` annotation) at simulated engines; routers read it through a
kubeconfig file, as one outside a cluster does, and real requests show which
engine and rank answered.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from click.testing import CliRunner
from yarl import URL

from dprouter.cli.serve import serve
from dprouter.config import RouterConfig, validate
from dprouter.core.errors import ConfigError, PodError
from dprouter.multiproc.supervisor import Supervisor
from dprouter.server.router import Router
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, metric_sum, until
from tests.kube_apiserver import KubeApiServer, pod
from tests.test_cli import _serve, listening
from tests.test_etcd import Relay, serving
from tests.test_router_pd import engine

NS = "llm"


@pytest.fixture
async def kube() -> AsyncIterator[KubeApiServer]:
    server = KubeApiServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def kubeconfig(tmp_path: Path, server: str, token: str = "t", **cluster: Any) -> str:
    """A kubeconfig file whose current context is the stand-in."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u", "namespace": NS}}],
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": {"token": token}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


Start = Callable[..., Awaitable[Router]]


@pytest.fixture
def router(kube: KubeApiServer, start_router: StartRouter, tmp_path: Path) -> Start:
    async def start(**options: Any) -> Router:
        options = {"selector": "app=engine", "resync": 60.0, **options}
        config = RouterConfig(discovery="k8s", kubeconfig=kubeconfig(tmp_path, kube.url), **options)
        return await start_router(config, settle=False)

    return start


def ports(*urls: str) -> dict[str, str]:
    return {"dprouter/ports": ",".join(str(URL(u).port) for u in urls)}


async def answered(
    http: aiohttp.ClientSession, router: Router | Supervisor, n: int
) -> Counter[str]:
    """``n`` requests: how many each engine/rank answered."""
    seen: Counter[str] = Counter()
    for _ in range(n):
        body = {"prompt": "hello", "max_tokens": 2}
        async with http.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            seen[f"{r.headers['x-sim-engine']}/{r.headers['x-sim-dp-rank']}"] += 1
    return seen


async def stale(http: aiohttp.ClientSession, router: Router) -> float:
    return await metric_sum(http, router.url, "dprouter_discovery_stale")


async def two_engines(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, **options: Any
) -> tuple[Router, list[str]]:
    """Two engines of two ranks, one pod each (e0, e1), both routed to."""
    urls = (await start_cluster([EngineConfig(dp_size=2)] * 2)).urls
    for i, url in enumerate(urls):
        await kube.put(pod(f"e{i}", annotations=ports(url)))
    r = await router(**options)
    assert await until(lambda: all(serving(r, u) for u in urls))
    return r, urls


async def test_pods_turning_unready_and_ready_move_their_targets_within_1_s(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, http: aiohttp.ClientSession
) -> None:
    r, urls = await two_engines(start_cluster, kube, router)
    assert set(await answered(http, r, 8)) == {
        "engine-0/0",
        "engine-0/1",
        "engine-1/0",
        "engine-1/1",
    }
    assert sorted(r.registry.workers) == ["e0", "e1"]
    await kube.put(pod("e1", ready=False, annotations=ports(urls[1])))
    t0 = time.monotonic()
    assert await until(lambda: not serving(r, urls[1]), 1.0)
    assert time.monotonic() - t0 < 1.0
    assert set(await answered(http, r, 6)) == {"engine-0/0", "engine-0/1"}
    await kube.put(pod("e1", ready=True, annotations=ports(urls[1])))
    t0 = time.monotonic()
    assert await until(lambda: serving(r, urls[1]), 1.0)  # discovery included
    assert time.monotonic() - t0 < 1.0
    assert len(await answered(http, r, 8)) == 4


async def test_a_pod_deleted_while_the_watch_was_cut_is_gone_after_the_next_list(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, http: aiohttp.ClientSession
) -> None:
    r, urls = await two_engines(start_cluster, kube, router)
    kube.deaf = True  # from now on no watch hears of anything
    await kube.delete(NS, "e1", force=True)
    lists = kube.lists
    await asyncio.sleep(0.2)
    assert serving(r, urls[1])  # the event was lost: nothing else tells it
    kube.cut()
    assert await until(lambda: not serving(r, urls[1]), 1.0)
    assert kube.lists == lists + 1 and not r.registry.stale
    assert set(await answered(http, r, 4)) == {"engine-0/0", "engine-0/1"}


@pytest.mark.parametrize("as_http", [False, True], ids=["error-event", "http-410"])
async def test_a_410_gone_makes_the_router_list_again(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, as_http: bool
) -> None:
    kube.gone_as_http = as_http
    r, urls = await two_engines(start_cluster, kube, router)
    kube.deaf = True
    await kube.delete(NS, "e1", force=True)
    kube.compact()  # the deletion is no longer in the history a watch can replay
    kube.deaf = False
    lists = kube.lists
    await kube.end()  # the watch ends cleanly; the router resumes from its version: expired
    assert await until(lambda: not serving(r, urls[1]), 1.0)
    assert kube.lists == lists + 1 and serving(r, urls[0])


async def test_a_whole_list_every_resync_reconciles_even_if_every_event_is_lost(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start
) -> None:
    r, urls = await two_engines(start_cluster, kube, router, resync=0.5)
    kube.deaf = True
    await kube.delete(NS, "e1", force=True)
    assert await until(lambda: not serving(r, urls[1]), 2.0)
    await kube.put(pod("e1", annotations=ports(urls[1])))
    assert await until(lambda: serving(r, urls[1]), 2.0)


async def test_a_force_deleted_pod_and_a_terminating_pod_both_leave(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, http: aiohttp.ClientSession
) -> None:
    urls = (await start_cluster([EngineConfig(dp_size=2)] * 3)).urls
    for i, url in enumerate(urls):
        await kube.put(pod(f"e{i}", annotations=ports(url)))
    r = await router(resync=0.3)
    assert await until(lambda: all(serving(r, u) for u in urls))
    await kube.delete(NS, "e0")  # graceful: deletionTimestamp set, still Ready and listed
    await kube.delete(NS, "e1", force=True)  # a DELETED event, nothing before it
    assert await until(lambda: not serving(r, urls[0]) and not serving(r, urls[1]), 1.0)
    lists = kube.lists
    assert await until(lambda: kube.lists >= lists + 2, 2.0)  # whole lists since
    assert list(r.registry.workers) == ["e2"]  # the terminating pod stays out
    assert set(await answered(http, r, 4)) == {"engine-2/0", "engine-2/1"}


async def test_a_multi_port_pod_gives_one_worker_and_target_per_port(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, http: aiohttp.ClientSession
) -> None:
    # vLLM external DP load balancing: one API server per rank, each on its own port
    urls = (await start_cluster([EngineConfig(dp_size=1)] * 3)).urls
    await kube.put(pod("ranks", annotations=ports(*urls)))
    r = await router()
    assert await until(lambda: len(r.registry.snapshot.pool()) == 3)
    names = [f"ranks-{URL(u).port}" for u in urls]
    assert sorted(r.registry.workers) == sorted(names)
    assert await answered(http, r, 6) == Counter({f"engine-{i}/0": 2 for i in range(3)})
    await kube.put(pod("ranks", annotations=ports(*urls[:2])))  # one port dropped
    assert await until(lambda: len(r.registry.snapshot.pool()) == 2, 1.0)
    assert sorted(r.registry.workers) == sorted(names[:2])


async def test_a_pod_back_with_a_new_ip_is_routed_at_its_new_url(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, http: aiohttp.ClientSession
) -> None:
    (old,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    (new,) = (await start_cluster([EngineConfig(dp_size=1)], host="127.0.0.2")).servers
    await kube.put(pod("e0", annotations=ports(old.url)))
    r = await router()
    assert await until(lambda: serving(r, old.url))
    await kube.put(pod("e0", ip="127.0.0.2", annotations=ports(new.url)))  # restarted elsewhere
    assert await until(lambda: serving(r, new.url) and not serving(r, old.url), 1.0)
    assert r.registry.workers["e0"].url == new.url
    await answered(http, r, 3)
    assert len(new.received) == 3 and len(old.received) == 0


async def test_pd_selectors_fill_both_roles_and_the_bootstrap_annotation_reaches_sglang(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([engine("sglang", "prefill", 2), engine("sglang", "decode", 1)])
    prefill, decode = cluster.servers
    assert prefill.pd is not None and prefill.pd.bootstrap_port is not None
    relay = Relay(prefill.pd.bootstrap_port)  # a port only the annotation names
    await relay.start()
    try:
        notes = {**ports(prefill.url), "example.com/kv-port": str(relay.port)}
        await kube.put(pod("p0", labels={"app": "engine", "role": "prefill"}, annotations=notes))
        await kube.put(
            pod("d0", labels={"app": "engine", "role": "decode"}, annotations=ports(decode.url))
        )
        await kube.put(pod("x0", labels={"app": "engine"}, annotations=ports(decode.url)))
        r = await router(
            pd="sglang",
            prefill_selector="role=prefill",
            decode_selector="role=decode",
            bootstrap_port_annotation="example.com/kv-port",
        )
        assert await until(lambda: len(r.registry.snapshot.workers) == 2)
        assert {w.id: w.role for w in r.registry.workers.values()} == {
            "p0": "prefill",
            "d0": "decode",
        }
        assert r.registry.workers["p0"].bootstrap_port == relay.port
        for _ in range(4):
            body = {"prompt": "disaggregate me", "max_tokens": 2}
            async with http.post(r.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-dprouter-prefill"].startswith("p0")
        told = [rec.body for rec in decode.received if rec.path == "/v1/completions"]
        assert len(told) == 4 and {b["bootstrap_port"] for b in told} == {relay.port}
    finally:
        await relay.cut()


async def test_with_the_api_server_down_the_last_membership_keeps_routing(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, http: aiohttp.ClientSession
) -> None:
    r, urls = await two_engines(start_cluster, kube, router)
    assert await stale(http, r) == 0
    await kube.stop()
    assert await until(lambda: r.registry.stale, 2.0)
    assert await stale(http, r) == 1
    assert len(await answered(http, r, 8)) == 4  # every target of both engines still
    await kube.delete(NS, "e1", force=True)  # while the router cannot see
    await kube.start()  # the same port
    assert await until(lambda: not r.registry.stale, 6.0)  # backoff is at most 5 s
    assert await stale(http, r) == 0 and not serving(r, urls[1])
    assert set(await answered(http, r, 4)) == {"engine-0/0", "engine-0/1"}


async def test_the_admin_api_refuses_to_remove_a_pods_worker(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start, http: aiohttp.ClientSession
) -> None:
    r, urls = await two_engines(start_cluster, kube, router, admin_token="a")
    async with http.delete(r.url + "/workers/e1", headers={"Authorization": "Bearer a"}) as resp:
        assert resp.status == 409
        assert "Kubernetes owns it" in (await resp.json())["error"]["message"]
    assert serving(r, urls[1])


async def test_under_processes_the_parent_follows_the_pods_and_both_processes_route(
    start_cluster: StartCluster, kube: KubeApiServer, tmp_path: Path
) -> None:
    (engine0,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    config = RouterConfig(
        discovery="k8s",
        kubeconfig=kubeconfig(tmp_path, kube.url),
        selector="app=engine",
        port=0,
        processes=2,
        grace=2.0,
    )
    sup = Supervisor(config)
    await sup.start()
    try:
        await kube.put(pod("e0", annotations=ports(engine0.url)))
        assert await until(lambda: len(sup.registry.snapshot.pool()) == 2)
        await asyncio.sleep(0.3)  # the state reaches both processes
        connector = aiohttp.TCPConnector(force_close=True)  # either process may take one
        async with aiohttp.ClientSession(connector=connector) as s:
            assert set(await answered(s, sup, 8)) == {"engine-0/0", "engine-0/1"}
        await kube.delete(NS, "e0", force=True)
        assert await until(lambda: not sup.registry.snapshot.workers)
        assert kube.watches >= 1
    finally:
        await sup.stop()


def test_kubernetes_options_are_checked_at_start_up() -> None:
    good = RouterConfig(discovery="k8s", selector="app=engine,tier!=cpu", pod_port=8000)
    assert validate(good).selector == "app=engine,tier!=cpu"
    bad = [
        RouterConfig(selector="app=engine"),  # without --discovery k8s
        RouterConfig(discovery="k8s"),  # no selector
        RouterConfig(discovery="k8s", selector="app"),
        RouterConfig(discovery="k8s", selector="a=b", prefill_selector="r=p"),  # no --pd
        RouterConfig(discovery="k8s", pd="sglang", prefill_selector="r=p"),  # no decode
        RouterConfig(discovery="k8s", selector="a=b", resync=0),
        RouterConfig(discovery="kubernetes"),
        RouterConfig(
            discovery="k8s", pd="vllm-moriio", prefill_selector="r=p", decode_selector="r=d"
        ),
    ]
    for config in bad:
        with pytest.raises(ConfigError):
            validate(config)


async def test_serve_takes_kubernetes_options_from_its_config_file(
    start_cluster: StartCluster, kube: KubeApiServer, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    gpu, cpu = (await start_cluster([EngineConfig(dp_size=2)] * 2)).urls
    await kube.put(pod("e0", labels={"app": "engine", "tier": "gpu"}, annotations=ports(gpu)))
    await kube.put(pod("c0", labels={"app": "engine", "tier": "cpu"}, annotations=ports(cpu)))
    config = tmp_path / "router.toml"
    config.write_text(
        'discovery = "k8s"\nselector = "app=engine,tier!=cpu"\nnamespace = "llm"\n'
        f'kubeconfig = "{kubeconfig(tmp_path, kube.url)}"\n'
    )
    proc = await _serve("--config", str(config))
    try:
        base, line = await listening(proc)
        assert "2 target(s)" in line, line  # the first list came before the report
        async with http.post(base + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 200 and r.headers["x-dprouter-target"].startswith("e0/")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 10)


def test_serve_refuses_a_kubeconfig_it_cannot_read(tmp_path: Path) -> None:
    args = ["--discovery", "k8s", "--selector", "app=engine"]
    done = CliRunner().invoke(serve, [*args, "--kubeconfig", str(tmp_path / "missing")])
    assert done.exit_code == 2 and "cannot read the kubeconfig" in done.output


def test_which_workers_a_pod_is() -> None:
    rules = RouterConfig(pod_port=8000).pod_rules()
    assert [(s.id, s.url) for s in rules.workers(pod("a", ip="10.1.2.3"))] == [
        ("a", "http://10.1.2.3:8000")
    ]
    assert [s.url for s in rules.workers(pod("v6", ip="fd00::7"))] == ["http://[fd00::7]:8000"]
    terminating = pod("t")
    terminating["metadata"]["deletionTimestamp"] = "2026-12-01T10:05:00Z"
    for outside in (pod("u", ready=False), pod("n", ip=None), terminating):
        assert rules.workers(outside) == []
    multi = pod("m", annotations={"dprouter/ports": "9000, 9001", "dprouter/worker": "dp_size=1"})
    assert [(s.id, s.url, s.dp_size) for s in rules.workers(multi)] == [
        ("m-9000", "http://127.0.0.1:9000", 1),
        ("m-9001", "http://127.0.0.1:9001", 1),
    ]
    keyed = pod("k", annotations={"dprouter/worker": "dialect=vllm,dp-size=8,rank_offset=8"})
    (spec,) = rules.workers(keyed)
    assert (spec.dialect, spec.dp_size, spec.rank_offset) == ("vllm", 8, 8)
    bad = [
        {"dprouter/ports": "80,80"},
        {"dprouter/ports": "http"},
        {"dprouter/ports": "70000"},
        {"dprouter/worker": "id=x"},
        {"dprouter/worker": "colour=red"},
        {"dprouter/worker": "dp_size=many"},
        {"dprouter/ports": "1,2", "dprouter/worker": "rank_offset=4"},
        {"sglang.ai/bootstrap-port": "x"},
    ]
    for notes in bad:
        with pytest.raises(PodError):
            rules.workers(pod("b", annotations=notes))
    with pytest.raises(PodError, match="--pod-port"):
        RouterConfig().pod_rules().workers(pod("p"))


def test_pd_selectors_give_roles_and_a_pod_matching_neither_is_no_worker() -> None:
    config = RouterConfig(pod_port=1, prefill_selector="r=p", decode_selector="r=d,gpu!=none")
    rules = config.pod_rules()
    boot = {"sglang.ai/bootstrap-port": "8998"}
    (p,) = rules.workers(pod("p", labels={"r": "p"}, annotations=boot))
    (d,) = rules.workers(pod("d", labels={"r": "d"}))
    assert (p.role, p.bootstrap_port, d.role) == ("prefill", 8998, "decode")
    assert rules.workers(pod("x", labels={"r": "d", "gpu": "none"})) == []
    both = RouterConfig(pod_port=1, prefill_selector="a=1", decode_selector="b=1").pod_rules()
    with pytest.raises(PodError, match="both"):
        both.workers(pod("y", labels={"a": "1", "b": "1"}))


async def test_the_worker_annotation_reaches_discovery(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start
) -> None:
    (engine0,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    notes = {**ports(engine0.url), "dprouter/worker": "dp_size=4"}  # the engine has 2
    await kube.put(pod("e0", annotations=notes))
    r = await router()
    assert await until(
        lambda: "e0" in r.registry.workers and r.registry.workers["e0"].state == "error"
    )
    assert "configured with dp_size 4" in (r.registry.workers["e0"].error or "")


async def test_garbage_from_the_api_server_marks_it_stale_and_the_router_recovers(
    start_cluster: StartCluster, kube: KubeApiServer, router: Start
) -> None:
    r, urls = await two_engines(start_cluster, kube, router)
    kube.garbled = 2  # the re-list after the cut, and the next try
    kube.deaf = True
    await kube.delete(NS, "e1", force=True)
    kube.cut()
    assert await until(lambda: r.registry.stale, 1.0)
    assert serving(r, urls[1])  # the last membership stands meanwhile
    assert await until(lambda: not r.registry.stale and not serving(r, urls[1]), 3.0)
