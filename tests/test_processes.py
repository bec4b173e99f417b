"""``--processes 2``: two serving processes on one port, against simulated engines.

Each test starts the parent (``Supervisor``) in-process; its serving processes
are real processes. Clients open a connection per request, so the kernel
spreads them over both processes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import aiohttp
import pytest

from dprouter.config import RouterConfig
from dprouter.core.types import PdMode
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.multiproc.supervisor import Supervisor
from dprouter.proxy.output_budget import OutputEstimate
from dprouter.sim.model.config import EngineConfig, Faults, PdConfig, RankLimits
from tests.conftest import StartCluster, StartProcesses, metric_sum, until, workers
from tests.test_door import held_everywhere

LONG: dict[str, Any] = {"prompt": "a long answer", "max_tokens": 3000, "stream": True}
SHORT: dict[str, Any] = {"prompt": "route me", "max_tokens": 2}


def fresh() -> aiohttp.ClientSession:
    """A client whose every request opens a connection of its own."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """One request on a connection of its own (so either process may accept it)."""
    async with fresh() as s, s.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-sim-engine"], r.headers["x-sim-dp-rank"]


async def hold_stream(url: str, opened: list[int]) -> None:
    """A long stream, read until cancelled; ``opened`` counts the ones under way."""
    async with fresh() as s, s.post(url + "/v1/completions", json=LONG) as r:
        assert r.status == 200
        await r.content.readline()
        opened.append(1)
        async for _ in r.content:
            pass


async def pair(url: str, i: int) -> tuple[str, str]:
    """One P/D request (every other one streamed): the (prefill, decode) targets it took."""
    body = {**SHORT, "stream": i % 2 == 1}
    async with fresh() as s, s.post(url + "/v1/completions", json=body) as r:
        text = await r.text()
        assert r.status == 200 and "error" not in text, text
        return r.headers["x-dprouter-prefill"], r.headers["x-dprouter-target"]


def in_flight(sup: Supervisor) -> int:
    return sum(t.outstanding for t in sup.registry.targets())


def upstream_owners(pids: list[int], port: int) -> set[int]:
    """Which of ``pids`` hold a TCP connection to local ``port`` (from /proc)."""
    inodes: set[str] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
            inodes.add(fields[9])
    owners = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                owners.add(pid)
    return owners


async def test_least_load_puts_exactly_3_of_24_slow_requests_on_each_of_8_targets(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=4), EngineConfig(dp_size=4)])
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls), policy="least_load"))
    opened: list[int] = []
    tasks = [asyncio.create_task(hold_stream(sup.url, opened)) for _ in range(24)]
    try:
        assert await until(lambda: len(opened) == 24, seconds=20)
        ranks = Counter((s.engine_id, rec.rank) for s in cluster.servers for rec in s.received)
        assert len(ranks) == 8 and set(ranks.values()) == {3}, ranks
        assert in_flight(sup) == 24  # the parent sees both processes' counts
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert await until(lambda: in_flight(sup) == 0, seconds=10)


@pytest.mark.parametrize(
    ("policy", "assignment"),
    [
        ("manual", "random"),
        ("manual", "min_load"),
        ("manual", "min_group"),
        ("consistent_hash", None),
    ],
)
async def test_a_key_on_20_connections_always_reaches_one_target(
    start_cluster: StartCluster,
    start_processes: StartProcesses,
    policy: str,
    assignment: str | None,
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=4), EngineConfig(dp_size=4)])
    # 20 at once on one key would push its target past --session-bound: keys stay put here
    config = RouterConfig(
        workers=workers(*cluster.urls), policy=policy, assignment=assignment, session_bound=0
    )
    sup = await start_processes(config)
    for key in ("alice", "bob"):
        seen = await asyncio.gather(
            *(post(sup.url, SHORT, {"X-Session-ID": key}) for _ in range(20))
        )
        assert len(set(seen)) == 1, Counter(seen)


async def test_an_admin_added_worker_gets_traffic_from_both_processes(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    first, second = (await start_cluster([EngineConfig(dp_size=2)])).urls[0], None
    cluster = await start_cluster([EngineConfig(dp_size=2)])
    second = cluster.urls[0]
    sup = await start_processes(RouterConfig(workers=workers(first), admin_token="t"))
    auth = {"Authorization": "Bearer t"}
    add = f"{sup.url}/workers?wait=5"
    async with fresh() as s, s.post(add, json={"url": second}, headers=auth) as r:
        assert r.status == 201, await r.text()
        assert (await r.json())["state"] == "ready"
    # every process routes to it within a second, each over its own connections
    port = int(second.rsplit(":", 1)[1])
    pids = [c.pid for c in sup.children.values() if c.pid is not None]

    for _ in range(5):
        await asyncio.gather(*(post(sup.url, SHORT) for _ in range(16)))
        if upstream_owners(pids, port) == set(pids):
            break
    assert upstream_owners(pids, port) == set(pids)
    assert len(cluster.servers[0].received) >= 2
    # removed by its URL, quoted, as 0.2.x gateways are asked: relayed as it came
    gone = f"{sup.url}/workers/{quote(second, safe='')}"
    async with fresh() as s, s.delete(gone, headers=auth) as r:
        assert r.status == 200 and (await r.json())["url"] == second


async def test_the_metrics_port_answers_for_the_whole_router(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    """--metrics-port (the launch line's --prometheus-port) under two serving processes:
    both listen on it, and whichever takes a scrape counts the requests of both."""
    cluster = await start_cluster([EngineConfig(dp_size=2)])
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls), metrics_port=0))
    assert sup.metrics_port not in (None, 0, sup.port) and sup.metrics_url is not None
    await asyncio.gather(*(post(sup.url, SHORT) for _ in range(16)))
    base = sup.metrics_url.removesuffix("/metrics")
    for _ in range(6):  # each scrape on a connection of its own: either process answers
        async with fresh() as s:
            assert await metric_sum(s, base, "dprouter_requests_total") == 16
    async with fresh() as s, s.get(base + "/v1/models") as r:
        assert r.status == 404  # the metrics port serves /metrics alone


async def test_each_engine_is_scraped_once_per_interval_whatever_the_processes(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=2)])
    interval = 0.2
    await start_processes(RouterConfig(workers=workers(*cluster.urls), load_interval=interval))
    hits = cluster.servers[0].hits
    before = hits["GET /metrics"]
    await asyncio.sleep(2.0)
    scrapes = hits["GET /metrics"] - before
    assert 2.0 / interval * 0.5 <= scrapes <= 2.0 / interval + 1  # once, not twice, per interval


async def test_a_killed_serving_process_is_replaced_and_its_counts_released(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=4)])
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls)))
    opened: list[int] = []
    tasks = [asyncio.create_task(hold_stream(sup.url, opened)) for _ in range(12)]
    try:
        assert await until(lambda: len(opened) == 12, seconds=20)
        assert in_flight(sup) == 12
        victim = sup.children[0]
        held = int(sup.board.own_inflight[0].sum()) // 2  # its row counts targets and workers
        work = int(sup.board.own_work[0].sum())  # the decode work its streams had left
        assert work > 0
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        assert await until(lambda: sup.replaced == 1 and len(sup.control.listening) == 2)
        assert sup.children[0].pid != victim.pid
        # its streams are gone, and so are their counts; the other process's stand
        assert await until(lambda: in_flight(sup) == 12 - held, seconds=5)
        with sup.board.step():  # the other process's streams spend theirs meanwhile
            whole, others = int(sup.board.work.sum()), int(sup.board.own_work[1].sum())
        assert whole == others  # the killed process's work went with its requests
        assert sum(t.done() for t in tasks) == held
        assert (await post(sup.url, SHORT))[0] == "engine-0"  # still serving
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert await until(lambda: in_flight(sup) == 0, seconds=10)
    assert not sup.board.work.any()


def linger() -> None:
    """Close every file, then live on a moment: a serving process on its way out, as its
    parent sees it (its sentinel reads as closed before it can be reaped)."""
    os.closerange(3, 1 << 16)
    time.sleep(0.3)


async def test_a_serving_process_is_reaped_however_late_its_exit_completes() -> None:
    """The parent learns that a serving process ended from its sentinel, which reads as
    closed a moment before the process can be reaped. Reaping without waiting found it
    running, nothing reaped it after, and a stop waited out the grace for it (seen after a
    killed process was replaced: SIGTERM to the idle parent took the grace + 5 s)."""
    sup = Supervisor(RouterConfig(port=0, processes=2, grace=1.0))  # not started: no children
    try:
        sup.stopping = True  # as when stop() has signalled them
        child = multiprocessing.get_context("spawn").Process(target=linger)
        child.start()
        sup.children[0] = child
        sup.watch(0, child)
        # a bound, not a speed: a spawned child imports this module first, which took
        # over 5 s on a 2-core machine under load
        async with asyncio.timeout(60):
            await sup.ended.wait()
        assert child.exitcode == 0
        assert child.pid is not None
        with pytest.raises(ProcessLookupError):  # reaped: not even a zombie is left
            os.kill(child.pid, 0)
    finally:
        await sup.stop()


async def test_sigterm_drains_both_processes_with_the_one_grace(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=4)])
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls), grace=10.0))
    body = {**LONG, "max_tokens": 150}  # about a second each

    async def whole() -> bytes:
        async with fresh() as s, s.post(sup.url + "/v1/completions", json=body) as r:
            return await r.read()

    streams = [asyncio.create_task(whole()) for _ in range(8)]
    assert await until(lambda: in_flight(sup) == 8, seconds=10)
    await sup.stop()  # SIGTERM to both; returns once both have exited
    answers = await asyncio.gather(*streams)
    assert all(a.rstrip().endswith(b"data: [DONE]") and b"error" not in a for a in answers)
    assert [c.exitcode for c in sup.children.values()] == [0, 0]
    with pytest.raises(aiohttp.ClientConnectionError):
        await post(sup.url, SHORT)


async def test_metrics_count_the_requests_of_every_process(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=2)])
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls)))
    await asyncio.gather(*(post(sup.url, SHORT) for _ in range(20)))
    async with aiohttp.ClientSession() as http:
        assert await metric_sum(http, sup.url, "dprouter_requests_total") == 20


async def test_a_breaker_opened_by_failures_in_any_process_holds_in_all(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    failing = EngineConfig(dp_size=4, faults=Faults(failing_ranks=frozenset({1})))
    cluster = await start_cluster([failing])
    config = RouterConfig(workers=workers(*cluster.urls), breaker_failures=2, breaker_cooldown=60.0)
    sup = await start_processes(config)
    # both processes meet the failing rank; each failure is retried elsewhere
    await asyncio.gather(*(post(sup.url, SHORT) for _ in range(16)))
    rank1 = next(t for t in sup.registry.targets() if t.rank == 1)
    assert await until(lambda: rank1.tripped)
    received = cluster.servers[0].received
    before = sum(rec.rank == 1 for rec in received)
    await asyncio.sleep(0.2)  # the state reaches both processes
    await asyncio.gather(*(post(sup.url, SHORT) for _ in range(24)))
    assert sum(rec.rank == 1 for rec in received) == before


async def test_cache_aware_follows_a_prefix_whichever_process_sent_it_first(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    cluster = await start_cluster([EngineConfig(dp_size=4), EngineConfig(dp_size=4)])
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls), policy="cache_aware"))
    control = sup.control

    def told_after(before: int) -> Callable[[], bool]:
        return lambda: control.forwarded > before

    for system in ("You are a pirate. " * 30, "You are a poet. " * 30):
        told = told_after(control.forwarded)
        home = await post(sup.url, {**SHORT, "prompt": system + "first"})
        assert await until(told)  # the other process knows
        # one after another, each on a connection of its own (either process accepts it):
        # at once, the load bound would rightly spread them
        seen = [await post(sup.url, {**SHORT, "prompt": system + f"q{i}"}) for i in range(12)]
        assert set(seen) == {home}


async def test_every_process_counts_a_request_by_the_lengths_all_of_them_saw_finish(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    """One short answer (2 tokens) finishes in one process; then long streams, one at a time
    and each on a connection of its own (either process accepts it): every one is counted
    by that answer's length, not by its 3,000-token cap, whichever process took it."""
    cluster = await start_cluster([EngineConfig(dp_size=2)])
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls), policy="min_tokens"))
    await post(sup.url, SHORT)
    board = OutputEstimate(board=sup.registry.board)  # the average both processes keep
    assert await until(lambda: board.budget(3000) == 2)
    opened: list[int] = []
    for _ in range(12):
        opened.clear()
        task = asyncio.create_task(hold_stream(sup.url, opened))
        try:
            assert await until(lambda: len(opened) == 1, seconds=10)
            counted = sum(t.outstanding_tokens for t in sup.registry.targets())
            assert 0 < counted < 100, counted  # the prompt + 2, not + 3,000
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert await until(lambda: in_flight(sup) == 0, seconds=10)


async def test_the_dispatcher_keeps_every_ranks_running_cap_across_both_processes(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    """A burst over both processes: each holds what finds no free slot, and a slot is
    taken on the shared board under its lock, so no rank ever gets more than its cap."""
    slots = 3
    engine = EngineConfig(
        persona="sglang", dp_size=2, dp_attention=True, limits=RankLimits(max_running=slots)
    )
    cluster = await start_cluster([replace(engine, time_scale=0.3)])
    (server,) = cluster.servers
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls)))
    most = 0

    async def watch() -> None:
        nonlocal most
        for _ in range(20_000):  # bounded: ~100 s
            for rank in server.engine.ranks:
                most = max(most, rank.num_running + len(rank.waiting))
            await asyncio.sleep(0.005)

    async def one(n: int) -> None:
        body = {"text": f"r{n}", "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
        async with fresh() as s, s.post(sup.url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["meta_info"]["completion_tokens"] == 30

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(one(n) for n in range(24)))
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    assert most == slots
    assert len(server.received) == 24  # none lost, none twice
    assert await until(lambda: in_flight(sup) == 0, seconds=10)


async def test_held_requests_go_out_longest_first_across_both_processes(
    start_cluster: StartCluster, start_processes: StartProcesses, http: aiohttp.ClientSession
) -> None:
    """One running slot. A long request runs in it while a burst of 16, of lengths that
    differ and in a shuffled order, each on a connection of its own, is held in both
    serving processes. The engine then receives them one at a time, longest first over
    the whole burst, whichever process holds each and whichever the slot frees in. (By
    each process's own order alone, the process a request ended in would hand the slot
    to its own first in line: its whole queue would go before the other's.)"""
    engine = EngineConfig(persona="sglang", limits=RankLimits(max_running=1), time_scale=0.5)
    (server,) = (await start_cluster([engine])).servers
    # aging at 1 token a second: the burst arrives within a second, its lengths 3 apart
    sup = await start_processes(RouterConfig(workers=workers(server.url), dispatch_aging=1.0))
    slots = [t.slot for t in sup.registry.targets()]
    assert await until(lambda: all(sup.board.cap[slots]))  # the engine's cap is read
    lengths = random.Random(48).sample(range(4, 52, 3), 16)

    def body(text: str, tokens: int) -> dict[str, Any]:
        return {"prompt": text, "max_tokens": tokens, "ignore_eos": True}

    runner = asyncio.create_task(post(sup.url, body("runner", 400)))
    assert await until(lambda: len(server.received) == 1)
    burst = [asyncio.create_task(post(sup.url, body(f"b{n}", n))) for n in lengths]
    assert await held_everywhere(http, sup.url, 16)
    assert all(sup.board.looked), "the burst is not held in both processes"
    assert len(server.received) == 1, "the runner ended before the burst was held"
    await asyncio.gather(runner, *burst)
    sent = [r.body["max_tokens"] for r in list(server.received)[1:]]
    assert sent == sorted(lengths, reverse=True), sent


async def test_a_process_that_stops_looking_holds_the_others_back_only_so_long(
    start_cluster: StartCluster, start_processes: StartProcesses, http: aiohttp.ClientSession
) -> None:
    """One running slot, requests held in both processes. The process whose first in line
    is the longest is stopped (SIGSTOP: alive, its first in line on the board, never
    looking again). When the slot frees, the other process takes it once the stopped one's
    look is stale (half a second) and sends what it holds; the stopped one's requests go
    once it runs again. None is lost."""
    engine = EngineConfig(persona="sglang", limits=RankLimits(max_running=1), time_scale=0.5)
    (server,) = (await start_cluster([engine])).servers
    sup = await start_processes(RouterConfig(workers=workers(server.url), dispatch_aging=1.0))
    (slot,) = [t.slot for t in sup.registry.targets()]
    assert await until(lambda: bool(sup.board.cap[slot]))

    def body(text: str, tokens: int) -> dict[str, Any]:
        return {"prompt": text, "max_tokens": tokens, "ignore_eos": True}

    runner = asyncio.create_task(post(sup.url, body("runner", 300)))
    assert await until(lambda: bool(sup.board.own_inflight[:, slot].any()))
    sends = int(sup.board.own_inflight[:, slot].argmax())  # the runner's process
    held: list[asyncio.Task[Any]] = []
    for n in range(30):  # longer each time, until the longest is held by the other process
        held.append(asyncio.create_task(post(sup.url, body(f"h{n}", 10 + 5 * n))))
        assert await held_everywhere(http, sup.url, len(held))
        best = int(sup.board.own_heads[:, slot].argmax())
        if best != sends and sup.board.own_heads[sends, slot]:  # and the runner's holds one
            break
    assert best != sends, "every request went to the runner's process"
    stopped = sup.children[best].pid
    assert stopped is not None
    os.kill(stopped, signal.SIGSTOP)
    try:
        await runner
        # the stopped process's first in line is the best on the board, yet the slot goes
        assert await until(lambda: len(server.received) > 1, seconds=10)
    finally:
        os.kill(stopped, signal.SIGCONT)
    await asyncio.gather(*held)
    assert len(server.received) == 1 + len(held)


@pytest.mark.parametrize("mode", ["vllm-nixl", "vllm-mooncake", "sglang"])
async def test_pd_flows_run_through_both_processes(
    start_cluster: StartCluster, start_processes: StartProcesses, mode: PdMode
) -> None:
    roles = [PdConfig(mode=mode, role=role, kv_wait=2.0) for role in ("prefill", "decode")]
    cluster = await start_cluster(
        [EngineConfig(persona=pd.persona, dp_size=2, pd=pd) for pd in roles]
    )
    prefill, decode = cluster.servers
    assert prefill.pd is not None
    port = prefill.pd.bootstrap_port if mode == "vllm-mooncake" else None  # vLLM does not say
    specs = (
        WorkerSpec(prefill.url, role="prefill", bootstrap_port=port),
        WorkerSpec(decode.url, role="decode"),
    )
    sup = await start_processes(RouterConfig(pd=mode, workers=specs))

    pairs = await asyncio.gather(*(pair(sup.url, i) for i in range(16)))
    assert {p for p, _ in pairs} == {"p0/0", "p0/1"} and {d for _, d in pairs} == {"d0/0", "d0/1"}
    assert len(decode.received) == 16
    assert await until(lambda: in_flight(sup) == 0)


async def test_pd_pairs_are_counted_with_the_decision_so_decodes_spread_exactly(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    """16 long P/D streams over 4 decode ranks, from both processes: 4 on each, because the
    pair and both legs' counts are one step for all processes."""
    roles = [PdConfig(mode="vllm-nixl", role=role) for role in ("prefill", "decode")]
    cluster = await start_cluster(
        [EngineConfig(persona=pd.persona, dp_size=4, pd=pd) for pd in roles]
    )
    prefill, decode = cluster.servers
    specs = (WorkerSpec(prefill.url, role="prefill"), WorkerSpec(decode.url, role="decode"))
    sup = await start_processes(RouterConfig(pd="vllm-nixl", workers=specs, policy="least_load"))
    opened: list[int] = []
    tasks = [asyncio.create_task(hold_stream(sup.url, opened)) for _ in range(16)]
    try:
        assert await until(lambda: len(opened) == 16, seconds=20)
        ranks = Counter(rec.rank for rec in decode.received)
        assert set(ranks.values()) == {4} and len(ranks) == 4, ranks
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert await until(lambda: in_flight(sup) == 0, seconds=10)


@pytest.mark.parametrize("assignment", ["random", "min_group"])
async def test_pd_a_key_on_20_connections_always_reaches_one_pair(
    start_cluster: StartCluster, start_processes: StartProcesses, assignment: str
) -> None:
    roles = [PdConfig(mode="vllm-nixl", role=role) for role in ("prefill", "decode")]
    cluster = await start_cluster(
        [EngineConfig(persona=pd.persona, dp_size=4, pd=pd) for pd in roles]
    )
    prefill, decode = cluster.servers
    specs = (WorkerSpec(prefill.url, role="prefill"), WorkerSpec(decode.url, role="decode"))
    # 20 at once on one key would push its pair past --session-bound: keys stay put here
    config = RouterConfig(
        pd="vllm-nixl", workers=specs, policy="manual", assignment=assignment, session_bound=0
    )
    sup = await start_processes(config)

    async def keyed(key: str) -> tuple[str, str]:
        async with (
            fresh() as s,
            s.post(sup.url + "/v1/completions", json=SHORT, headers={"X-Session-ID": key}) as r,
        ):
            assert r.status == 200, await r.text()
            return r.headers["x-dprouter-prefill"], r.headers["x-dprouter-target"]

    for key in ("alice", "bob", "carol"):
        seen = await asyncio.gather(*(keyed(key) for _ in range(20)))
        assert len(set(seen)) == 1, Counter(seen)


@pytest.mark.parametrize("transfer", ["READ", "WRITE"])
async def test_moriio_engines_register_once_and_both_processes_route_to_them(
    start_cluster: StartCluster, start_processes: StartProcesses, transfer: Literal["READ", "WRITE"]
) -> None:
    sup = await start_processes(RouterConfig(pd="vllm-moriio", registration="tcp://127.0.0.1:0"))
    assert sup.control.registration is not None  # in the parent, once
    address = sup.control.registration.address
    roles = [
        PdConfig(
            mode="vllm-moriio",
            role=role,
            transfer_mode=transfer,
            heartbeat=0.05,
            registration=address,
            kv_wait=2.0,
        )
        for role in ("prefill", "decode")
    ]
    cluster = await start_cluster(
        [EngineConfig(persona=pd.persona, dp_size=2, pd=pd) for pd in roles]
    )
    assert await until(lambda: len(sup.registry.snapshot.workers) == 2, seconds=10)
    await asyncio.sleep(0.3)  # the membership reaches both processes
    pids = [c.pid for c in sup.children.values() if c.pid is not None]
    decode_port = int(cluster.servers[1].url.rsplit(":", 1)[1])

    for _ in range(5):
        pairs = await asyncio.gather(*(pair(sup.url, i) for i in range(16)))
        assert len({p for p, _ in pairs}) == 2 and len({d for _, d in pairs}) == 2, pairs
        if upstream_owners(pids, decode_port) == set(pids):
            break
    assert upstream_owners(pids, decode_port) == set(pids)  # both processes routed
    assert await until(lambda: in_flight(sup) == 0)


async def test_a_stored_response_is_found_whichever_process_takes_the_follow_up(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    cluster = await start_cluster([EngineConfig()] * 4)
    sup = await start_processes(RouterConfig(workers=workers(*cluster.urls), policy="round_robin"))
    async with fresh() as s, s.post(sup.url + "/v1/responses", json={"input": "hi"}) as r:
        assert r.status == 200
        rid, made_by = (await r.json())["id"], r.headers["x-dprouter-target"]

    async def fetch() -> tuple[int, str | None]:
        async with fresh() as s, s.get(sup.url + f"/v1/responses/{rid}") as r:
            return r.status, r.headers.get("x-dprouter-target")

    seen = await asyncio.gather(*(fetch() for _ in range(20)))  # both processes take some
    assert set(seen) == {(200, made_by)}


async def test_a_pause_through_either_process_holds_the_workers_in_both(
    start_cluster: StartCluster, start_processes: StartProcesses
) -> None:
    """Engine commands run in the parent: a pause any process took holds every process's
    requests, and the update's version reaches every answer after it (P/D: both roles)."""
    roles = [PdConfig(mode="sglang", role=role, kv_wait=2.0) for role in ("prefill", "decode")]
    cluster = await start_cluster(
        [EngineConfig(persona="sglang", dp_size=2, pd=pd) for pd in roles]
    )
    prefill, decode = cluster.servers
    specs = (WorkerSpec(prefill.url, role="prefill"), WorkerSpec(decode.url, role="decode"))
    sup = await start_processes(RouterConfig(pd="sglang", workers=specs))
    async with fresh() as s:
        async with s.post(sup.url + "/pause_generation", json={"mode": "retract"}) as r:
            assert r.status == 200 and len((await r.json())["workers"]) == 2
        async with s.get(sup.url + "/v1/rl/workers") as r:
            held = [w["held"] for w in (await r.json())["workers"]]
        assert held == ["paused", "paused"]
    waiting = [asyncio.create_task(pair(sup.url, i)) for i in range(8)]  # over both processes
    await asyncio.sleep(0.5)
    assert not any(t.done() for t in waiting) and not decode.received
    async with fresh() as s:
        version = {"new_version": "v2", "abort_all_requests": False}
        async with s.post(sup.url + "/update_weight_version", json=version) as r:
            assert r.status == 200
        async with s.post(sup.url + "/continue_generation", json={}) as r:
            assert r.status == 200
    await asyncio.wait_for(asyncio.gather(*waiting), 10)
    assert len(decode.received) == 8 and decode.weights.version == "v2"
    async with fresh() as s, s.post(sup.url + "/v1/completions", json=SHORT) as r:
        assert r.headers["x-dprouter-weight-version"] == "v2"
    assert await until(lambda: in_flight(sup) == 0)
