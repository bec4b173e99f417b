"""Replicas that take their workers from a real etcd (the server binary, on loopback),
and share through it the holds and weight versions of the engine commands they relay.

Two routers run in-process as replicas; ``dprouter register`` runs as a real
process beside a simulated engine. Each test starts its own etcd with a
temporary data directory and stops it by its PID.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from dprouter.bench.harness.etcd_server import EtcdServer
from dprouter.config import RouterConfig, parse_discovery, validate
from dprouter.core.errors import ConfigError
from dprouter.fleet.membership.etcd_client import Etcd
from dprouter.multiproc.supervisor import Supervisor
from dprouter.server.router import Router
from dprouter.sim.model.config import EngineConfig, Faults
from tests.conftest import StartCluster, StartRouter, metric_sum, until
from tests.test_cli import _serve, listening

PREFIX = "/dprouter/"


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        server.release()


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[Etcd]:
    async with aiohttp.ClientSession() as session:
        yield Etcd([etcd.url], session)


Replicas = Callable[..., Awaitable[list[Router]]]


@pytest.fixture
def replicas(etcd: EtcdServer, start_router: StartRouter) -> Replicas:
    async def start(n: int = 2, url: str | None = None, **options: object) -> list[Router]:
        discovery = f"etcd://{(url or etcd.url).removeprefix('http://')}/dprouter"
        config = RouterConfig(discovery=discovery, admin_token="t", **options)  # type: ignore[arg-type]
        return [await start_router(config, settle=False) for _ in range(n)]

    return start


async def listed(client: Etcd, urls: list[str]) -> None:
    """A key per engine, as an operator or the admin API writes one (no lease)."""
    for i, url in enumerate(urls):
        await client.put(PREFIX + f"e{i}", orjson.dumps({"url": url}))


def serving(router: Router, url: str) -> bool:
    return any(w.url == url for w in router.registry.snapshot.workers)


async def register(etcd: EtcdServer, worker: str, ttl: int = 3) -> asyncio.subprocess.Process:
    """``dprouter register`` beside an engine; returns once it says it registered."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "dprouter", "register", "--etcd", etcd.url.removeprefix("http://")),
        *("--prefix", "dprouter", "--worker", worker, "--ttl", str(ttl)),
        *("--health-interval", "0.3"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    await said(proc, "registered ")
    return proc


async def said(proc: asyncio.subprocess.Process, words: str, seconds: float = 20) -> None:
    assert proc.stderr is not None
    async with asyncio.timeout(seconds):
        while True:
            line = (await proc.stderr.readline()).decode()
            assert line, f"register exited before saying {words!r}"
            if words in line:
                return


async def answer(http: aiohttp.ClientSession, router: Router | Supervisor) -> str:
    body = {"prompt": "hello", "max_tokens": 2}
    async with http.post(router.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-sim-engine"]


def test_a_discovery_url_names_endpoints_and_a_prefix() -> None:
    assert parse_discovery("etcd://a:2379,b:2379/dp/x/") == (
        ["http://a:2379", "http://b:2379"],
        "/dp/x/",
    )
    for bad in ("http://a:2379/p", "etcd://a:2379", "etcd:///p"):
        with pytest.raises(ConfigError):
            parse_discovery(bad)


def test_a_hold_lease_is_etcds_and_at_least_its_shortest() -> None:
    with pytest.raises(ConfigError, match="only with --discovery etcd"):
        validate(RouterConfig(hold_lease=5))
    with pytest.raises(ConfigError, match="hold_lease must be >= 2"):
        validate(RouterConfig(discovery="etcd://a:2379/p", hold_lease=1))
    assert validate(RouterConfig(discovery="etcd://a:2379/p", hold_lease=3)).hold_lease == 3


async def test_register_brings_a_worker_to_both_replicas_and_sigterm_takes_it_away(
    start_cluster: StartCluster, etcd: EtcdServer, replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    a, b = await replicas()
    proc = await register(etcd, f"{engine.url},dialect=vllm")
    t0 = time.monotonic()
    assert await until(lambda: serving(a, engine.url) and serving(b, engine.url), 2.0)
    joined = time.monotonic() - t0
    assert joined < 2.0
    assert {await answer(http, r) for r in (a, b) for _ in range(2)} == {"engine-0"}
    assert len(a.registry.snapshot.pool()) == 2  # both ranks, discovered as today
    proc.send_signal(signal.SIGTERM)
    assert await until(lambda: not (serving(a, engine.url) or serving(b, engine.url)), 2.0)
    assert await asyncio.wait_for(proc.wait(), 5) == 0


async def test_a_killed_register_leaves_both_replicas_within_its_ttl(
    start_cluster: StartCluster, etcd: EtcdServer, replicas: Replicas
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    a, b = await replicas()
    proc = await register(etcd, f"{engine.url},dialect=vllm", ttl=2)
    assert await until(lambda: serving(a, engine.url) and serving(b, engine.url))
    proc.kill()
    await proc.wait()
    t0 = time.monotonic()
    assert await until(lambda: not (serving(a, engine.url) or serving(b, engine.url)), 4.0)
    assert time.monotonic() - t0 <= 2.0 + 1.0  # the TTL, and etcd's expiry tick


async def test_an_engine_failing_its_health_check_is_deregistered(
    start_cluster: StartCluster, etcd: EtcdServer, replicas: Replicas, client: Etcd
) -> None:
    # healthy long enough to be registered and routed to first, even on a loaded machine
    # (at 3 s a clean-clone CI run, beside other work, saw it fail before it was serving)
    failing = EngineConfig(dp_size=2, faults=Faults(health_fail_after=8.0))
    (engine,) = (await start_cluster([failing])).servers
    (a,) = await replicas(1)
    proc = await register(etcd, f"{engine.url},dialect=vllm")
    try:
        assert await until(lambda: serving(a, engine.url), 7.0)
        await said(proc, "fails its health check")
        assert await until(lambda: not serving(a, engine.url), 2.0)
        assert (await client.read(PREFIX))[0] == []  # the key is gone, not just the worker
    finally:
        proc.kill()
        await proc.wait()


async def test_the_admin_api_writes_to_etcd_so_every_replica_follows(
    start_cluster: StartCluster, replicas: Replicas, http: aiohttp.ClientSession, client: Etcd
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    a, b = await replicas()
    auth = {"Authorization": "Bearer t"}
    async with http.post(
        a.url + "/workers?wait=5", json={"url": engine.url, "id": "big"}, headers=auth
    ) as r:
        assert r.status == 201, await r.text()
        added = await r.json()
    assert added["etcd_key"] == PREFIX + "big" and added["state"] == "ready"
    assert await until(lambda: serving(b, engine.url))
    entries, _ = await client.read(PREFIX)
    assert [orjson.loads(e.value)["url"] for e in entries] == [engine.url]
    async with http.delete(b.url + "/workers/big", headers=auth) as r:
        assert r.status == 200 and (await r.json())["etcd_key"] == PREFIX + "big"
    assert await until(lambda: not (serving(a, engine.url) or serving(b, engine.url)))


async def test_a_bad_key_is_skipped_and_the_others_still_join(
    start_cluster: StartCluster, replicas: Replicas, client: Etcd
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    await client.put(PREFIX + "junk", b"not json")
    await client.put(PREFIX + "nourl", b'{"role": "regular"}')
    await client.put(PREFIX + "good", orjson.dumps({"url": engine.url}))
    (a,) = await replicas(1)
    assert await until(lambda: serving(a, engine.url))
    assert list(a.registry.workers) == ["good"]


class Relay:
    """A loopback TCP relay to etcd that a test can cut (every connection, and the
    listener) and restore on the same port: one replica's watch, cut."""

    def __init__(self, to_port: int) -> None:
        self.to_port = to_port
        self.port = 0
        self.server: asyncio.Server | None = None
        self.open: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            self._relay, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.open:
            writer.transport.abort()
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.to_port)
        self.open |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self.open -= {writer, up_writer}


async def stale(http: aiohttp.ClientSession, router: Router) -> float:
    return await metric_sum(http, router.url, "dprouter_discovery_stale")


async def test_a_deletion_made_while_a_replicas_watch_was_cut_is_applied_after(
    start_cluster: StartCluster,
    etcd: EtcdServer,
    replicas: Replicas,
    client: Etcd,
    http: aiohttp.ClientSession,
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    relay = Relay(etcd.client)
    await relay.start()
    try:
        await cut_and_restore(engine.url, relay, replicas, client, http)
    finally:
        await relay.cut()


async def cut_and_restore(
    url: str, relay: Relay, replicas: Replicas, client: Etcd, http: aiohttp.ClientSession
) -> None:
    (cut,) = await replicas(1, url=f"127.0.0.1:{relay.port}")
    (whole,) = await replicas(1)
    await client.put(PREFIX + "e", orjson.dumps({"url": url}))
    assert await until(lambda: serving(cut, url) and serving(whole, url))
    await relay.cut()
    assert await until(lambda: cut.registry.stale)
    await client.delete(PREFIX + "e")
    revision = await client.put(PREFIX.rstrip("/") + "-other", b"x")  # history moves on...
    await client.compact(revision)  # ...and the deletion's event is compacted away
    assert await until(lambda: not serving(whole, url))
    assert serving(cut, url)  # the last membership read keeps routing meanwhile
    assert await stale(http, cut) == 1 and await stale(http, whole) == 0
    assert await answer(http, cut) == "engine-0"
    await relay.start()  # the same port again
    assert await until(lambda: not serving(cut, url), 8.0)  # backoff is at most 5 s
    assert not cut.registry.stale and await stale(http, cut) == 0


async def test_with_etcd_down_for_10_s_replicas_keep_routing_then_follow_again(
    start_cluster: StartCluster,
    etcd: EtcdServer,
    replicas: Replicas,
    client: Etcd,
    http: aiohttp.ClientSession,
) -> None:
    first, second = (await start_cluster([EngineConfig(dp_size=2)] * 2)).servers
    a, b = await replicas()
    await client.put(PREFIX + "first", orjson.dumps({"url": first.url}))
    assert await until(lambda: serving(a, first.url) and serving(b, first.url))
    await etcd.stop()
    assert await until(lambda: a.registry.stale and b.registry.stale)
    answered: list[str] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10.0:  # bounded: ~10 s, two requests per round
        answered += await asyncio.gather(answer(http, a), answer(http, b))
        await asyncio.sleep(0.1)
    assert len(answered) >= 40 and set(answered) == {"engine-0"}  # answer() asserts 200
    assert await stale(http, a) == 1
    await etcd.start()  # the same data and ports
    await client.put(PREFIX + "second", orjson.dumps({"url": second.url}))
    assert await until(lambda: serving(a, second.url) and serving(b, second.url), 8.0)
    assert serving(a, first.url) and not (a.registry.stale or b.registry.stale)


async def test_under_processes_the_parent_follows_etcd_and_both_processes_route(
    start_cluster: StartCluster, etcd: EtcdServer, client: Etcd
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    discovery = f"etcd://{etcd.url.removeprefix('http://')}/dprouter"
    sup = Supervisor(RouterConfig(discovery=discovery, port=0, processes=2, grace=2.0))
    await sup.start()
    try:
        await client.put(PREFIX + "e", orjson.dumps({"url": engine.url}))
        assert await until(lambda: len(sup.registry.snapshot.pool()) == 2)
        await asyncio.sleep(0.3)  # the state reaches both processes

        async def one() -> str:
            connector = aiohttp.TCPConnector(force_close=True)  # either process may take it
            async with aiohttp.ClientSession(connector=connector) as s:
                return await answer(s, sup)

        assert set(await asyncio.gather(*(one() for _ in range(16)))) == {"engine-0"}
        await client.delete(PREFIX + "e")
        assert await until(lambda: not sup.registry.snapshot.workers)
    finally:
        await sup.stop()


async def turn(
    http: aiohttp.ClientSession, router: Router | Supervisor, key: str
) -> tuple[str, str]:
    body = {"prompt": "a turn", "max_tokens": 2}
    headers = {"X-Session-ID": key}
    async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-sim-engine"], r.headers["x-sim-dp-rank"]


async def test_50_keys_x_4_turns_sent_alternately_to_2_replicas_reach_their_first_target(
    start_cluster: StartCluster, replicas: Replicas, client: Etcd, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=4)] * 2)
    a, b = await replicas(sessions=True)  # manual, new keys placed by min_load
    await listed(client, cluster.urls)
    assert await until(lambda: all(len(r.registry.snapshot.pool()) == 8 for r in (a, b)))
    first: dict[str, tuple[str, str]] = {}
    for n in range(4):
        for k in range(50):
            key = f"session-{k}"
            seen = await turn(http, (a, b)[(n + k) % 2], key)
            assert first.setdefault(key, seen) == seen, key
    assert len(set(first.values())) == 8  # min_load spread the keys over every target
    claimed, _ = await client.read("/dprouter.sessions/")
    assert len(claimed) == 50


async def test_with_etcd_down_new_keys_land_alike_on_every_replica(
    start_cluster: StartCluster,
    etcd: EtcdServer,
    replicas: Replicas,
    client: Etcd,
    http: aiohttp.ClientSession,
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=4)] * 2)
    a, b = await replicas(sessions=True)
    await listed(client, cluster.urls)
    assert await until(lambda: all(len(r.registry.snapshot.pool()) == 8 for r in (a, b)))
    await etcd.stop()
    for _ in range(3):  # a's own rotation now differs from b's
        await answer(http, a)
    for k in range(20):
        key = f"offline-{k}"
        assert await turn(http, a, key) == await turn(http, b, key), key


async def test_keys_follow_across_replicas_of_two_processes_each(
    start_cluster: StartCluster, etcd: EtcdServer, client: Etcd
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=4)] * 2)
    await listed(client, cluster.urls)
    discovery = f"etcd://{etcd.url.removeprefix('http://')}/dprouter"
    config = RouterConfig(discovery=discovery, sessions=True, port=0, processes=2, grace=2.0)
    sups = [Supervisor(config), Supervisor(config)]
    try:
        for sup in sups:
            await sup.start()
        assert await until(lambda: all(len(s.registry.snapshot.pool()) == 8 for s in sups))
        await asyncio.sleep(0.3)  # the membership reaches every serving process
        first: dict[str, tuple[str, str]] = {}
        connector = aiohttp.TCPConnector(force_close=True)  # any process may take a turn
        async with aiohttp.ClientSession(connector=connector) as http:
            for n in range(3):
                for k in range(20):
                    key = f"s{k}"
                    seen = await turn(http, sups[(n + k) % 2], key)
                    assert first.setdefault(key, seen) == seen, key
        assert len(set(first.values())) > 1
    finally:
        for sup in sups:
            await sup.stop()


async def test_serve_reads_etcd_before_it_reports_its_targets(
    start_cluster: StartCluster, etcd: EtcdServer, client: Etcd, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    await client.put(PREFIX + "e", orjson.dumps({"url": engine.url}))
    proc = await _serve("--discovery", f"etcd://{etcd.url.removeprefix('http://')}/dprouter")
    try:
        base, line = await listening(proc)
        assert "2 target(s)" in line, line
        async with http.post(base + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 10)


# -- holds and weight versions across replicas (docs/replicas.md) --

SGLANG = EngineConfig(persona="sglang", dp_size=2, dp_attention=True, time_scale=0.05)
ADMIN = {"Authorization": "Bearer t"}  # the replicas' --admin-token
HOLDS = "/dprouter.holds/"


def held(router: Router | Supervisor) -> set[str | None]:
    return {w.held for w in router.registry.workers.values()}


def versions(router: Router | Supervisor) -> set[str | None]:
    return {w.weight_version for w in router.registry.workers.values()}


async def ready(routers: list[Router], n: int) -> None:
    assert await until(lambda: all(len(r.registry.snapshot.workers) == n for r in routers), 10)


async def command(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any] | None = None
) -> None:
    async with http.post(url + path, json=body or {}, headers=ADMIN) as r:
        assert r.status == 200, await r.text()


async def polled(
    http: aiohttp.ClientSession, url: str, check: Callable[[Any], bool], seconds: float = 10
) -> bool:
    """Poll ``url``'s ``GET /workers`` until ``check`` holds of it, for at most ``seconds``."""
    for _ in range(int(seconds / 0.05)):
        async with http.get(url + "/workers", headers=ADMIN) as r:
            if check(await r.json()):
                return True
        await asyncio.sleep(0.05)
    return False


async def generate(
    http: aiohttp.ClientSession, url: str, rid: str, header: bool = False
) -> tuple[int, str]:
    """A rollout through ``url``: its status, and the weights' version the engine said
    answered it (``header``: the one the router said)."""
    body = {"text": f"rollout {rid}", "rid": rid, "sampling_params": {"max_new_tokens": 4}}
    async with http.post(url + "/generate", json=body) as r:
        answer = await r.json(content_type=None)
        if r.status != 200:
            return r.status, ""
        if header:
            return r.status, r.headers["X-DPRouter-Weight-Version"]
        return r.status, str(answer["meta_info"]["weight_version"])


async def test_a_pause_through_one_replica_holds_every_replica_and_one_that_joins_later(
    start_cluster: StartCluster, replicas: Replicas, client: Etcd, http: aiohttp.ClientSession
) -> None:
    cluster = await start_cluster([SGLANG, SGLANG])
    a, b = await replicas()
    await listed(client, cluster.urls)
    await ready([a, b], 2)
    await command(http, a.url, "/pause_generation", {"mode": "retract"})
    assert await until(lambda: held(b) == {"paused"})
    assert not b.registry.snapshot.workers  # nothing left to route to
    # B routes nothing to the paused engines: its requests wait in B
    late = [asyncio.create_task(generate(http, b.url, f"late-{i}")) for i in range(4)]
    (c,) = await replicas(1)  # joins now: it reads the holds before its workers
    assert await c.settled(10) and held(c) == {"paused"}
    await command(
        http, a.url, "/update_weights_from_disk", {"model_path": "m", "weight_version": "7"}
    )
    assert await until(lambda: versions(b) == {"7"} and versions(c) == {"7"})
    assert held(b) == {"paused"}  # the update's own hold ended; the pause holds on
    sent = [r.body.get("rid", "") for s in cluster.servers for r in s.received]
    assert not [rid for rid in sent if rid.startswith("late")]
    assert not any(t.done() for t in late)
    await command(http, b.url, "/continue_generation")  # through another replica
    assert await until(lambda: all(held(r) == {None} for r in (a, b, c)))
    done = await asyncio.wait_for(asyncio.gather(*late), 20)
    assert done == [(200, "7")] * 4  # none lost, each on the new weights
    entries, _ = await client.read(HOLDS)
    assert sorted(e.key.removeprefix(HOLDS) for e in entries) == sorted(cluster.urls)
    assert {orjson.loads(e.value)["weight_version"] for e in entries} == {"7"}


async def test_a_hold_ends_within_its_lease_once_the_replica_that_relayed_it_is_killed(
    start_cluster: StartCluster,
    etcd: EtcdServer,
    replicas: Replicas,
    client: Etcd,
    http: aiohttp.ClientSession,
) -> None:
    cluster = await start_cluster([SGLANG])
    (engine,) = cluster.servers
    engine.weights.update_time = 60.0  # killed mid-update: the update never ends
    discovery = f"etcd://{etcd.url.removeprefix('http://')}/dprouter"
    proc = await _serve("--discovery", discovery, "--admin-token", "t", "--hold-lease", "2")
    try:
        url, _ = await listening(proc)
        (b,) = await replicas(1)
        await listed(client, cluster.urls)
        await ready([b], 1)
        assert await polled(http, url, lambda found: found["stats"]["healthy_workers"] == 1)
        update = asyncio.create_task(
            command(http, url, "/update_weights_from_disk", {"model_path": "m"})
        )
        assert await until(lambda: held(b) == {"updating its weights"})
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        t0 = time.monotonic()
        assert await until(lambda: held(b) == {None}, 5.0)
        assert time.monotonic() - t0 <= 2.0 + 1.0  # the lease, and etcd's expiry tick
        assert (await generate(http, b.url, "after"))[0] == 200
        assert (await client.read(HOLDS))[0] == []  # its key went with its lease
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    update.cancel()
    await asyncio.gather(update, return_exceptions=True)


async def test_a_replica_of_two_processes_shares_its_holds_both_ways(
    start_cluster: StartCluster,
    etcd: EtcdServer,
    replicas: Replicas,
    client: Etcd,
    http: aiohttp.ClientSession,
) -> None:
    """Under ``--processes 2`` the parent relays the commands and follows the holds."""
    cluster = await start_cluster([SGLANG, SGLANG])
    await listed(client, cluster.urls)
    discovery = f"etcd://{etcd.url.removeprefix('http://')}/dprouter"
    config = RouterConfig(discovery=discovery, admin_token="t", port=0, processes=2, grace=2.0)
    sup = Supervisor(config)
    await sup.start()
    try:
        (b,) = await replicas(1)
        assert await sup.settled(10)
        await ready([b], 2)
        await command(http, sup.url, "/pause_generation", {"mode": "in_place"})
        assert await until(lambda: held(b) == {"paused"})
        await command(http, b.url, "/continue_generation")
        assert await until(lambda: held(sup) == {None})
        await command(http, b.url, "/update_weight_version", {"new_version": "9"})
        assert await until(lambda: versions(sup) == {"9"})
        connector = aiohttp.TCPConnector(force_close=True)  # either process may take each
        async with aiohttp.ClientSession(connector=connector) as fresh:
            rollouts = (generate(fresh, sup.url, f"r{i}", header=True) for i in range(8))
            said = await asyncio.wait_for(asyncio.gather(*rollouts), 20)
        assert said == [(200, "9")] * 8  # released, and on the version B set, in both
    finally:
        await sup.stop()


async def test_a_pause_made_while_etcd_is_away_reaches_the_others_once_it_is_back(
    start_cluster: StartCluster,
    etcd: EtcdServer,
    replicas: Replicas,
    client: Etcd,
    http: aiohttp.ClientSession,
) -> None:
    cluster = await start_cluster([SGLANG])
    a, b = await replicas()
    await listed(client, cluster.urls)
    await ready([a, b], 1)
    await etcd.stop()
    await command(http, a.url, "/pause_generation", {"mode": "retract"})  # held here at once
    assert held(a) == {"paused"} and held(b) == {None}
    await etcd.start()  # the same data and ports
    assert await until(lambda: held(b) == {"paused"}, 8.0)  # backoff is at most 5 s
    await command(http, b.url, "/continue_generation")
    assert await until(lambda: held(a) == {None})
