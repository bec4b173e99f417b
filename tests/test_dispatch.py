"""The dispatcher: requests held in the router while every rank's running slots are taken,
then sent to the first rank with a free one, the longest predicted first.

The simulated SGLang reports its running cap per rank in ``/v1/loads`` as the real one
does; what the engine received (``received``, in order) and what it ran (its waiting
queue, polled) show what the router did."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from dprouter.bench.harness.rollout_burst import rollout
from dprouter.config import RouterConfig
from dprouter.core.types import Incoming
from dprouter.fleet.board import Board, size_of
from dprouter.proxy.heads import STALE, Heads, key, stamp
from dprouter.proxy.output_budget import OutputEstimate
from dprouter.proxy.parse import parse
from dprouter.proxy.plain import Proxy
from dprouter.server.router import Router
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import EngineConfig, RankLimits
from tests.conftest import (
    StartCluster,
    StartRouter,
    completions_engine,
    metric_sum,
    serving,
    until,
    workers,
)

SLOTS = 4  # running per rank
ATTENTION_DP = EngineConfig(
    persona="sglang",
    dp_size=2,
    dp_attention=True,
    limits=RankLimits(max_running=SLOTS),
    time_scale=0.3,
)


async def generate(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with http.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return int((await r.json())["meta_info"]["completion_tokens"])


class Queued:
    """The most requests any rank of ``server`` held at once, running and waiting,
    polled while the block runs."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.most = 0
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        for _ in range(20_000):  # bounded: ~100 s at most
            for rank in self.server.engine.ranks:
                self.most = max(self.most, rank.num_running + len(rank.waiting))
            await asyncio.sleep(0.005)

    async def __aenter__(self) -> Queued:
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def held(router: Router) -> int:
    proxy = router.parts.proxy
    assert isinstance(proxy, Proxy)
    return proxy.parts.dispatch.held


async def burst(http: aiohttp.ClientSession, url: str, bodies: Sequence[dict[str, Any]]) -> None:
    lengths = await asyncio.gather(*(generate(http, url, b) for b in bodies))
    assert list(lengths) == [b["sampling_params"]["max_new_tokens"] for b in bodies]


async def test_a_burst_waits_in_the_router_and_the_longest_go_first(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([ATTENTION_DP])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    assert [engine.engine.ranks[0].limits.max_running] * 2 == [
        t.board.cap_of(t.slot) for t in router.registry.targets()
    ]  # the caps as the engine reported them, before the first request
    shot = rollout(0, n=24)
    bodies = [shot.body(i) for i in range(len(shot))]
    async with Queued(engine) as queued:
        await burst(http, router.url, bodies)
    assert queued.most == SLOTS  # the engine never queued: the rest waited in the router
    sent = [r.body["sampling_params"]["max_new_tokens"] for r in engine.received]
    assert len(sent) == len(bodies)  # none lost, none sent twice
    held = sent[2 * SLOTS :]  # the first 8 found free slots; the rest were held
    assert held == sorted(held, reverse=True), held
    assert await metric_sum(http, router.url, "dprouter_held_requests") == 0


async def test_without_the_dispatcher_the_engine_queues_the_burst(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([ATTENTION_DP])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), dispatch="off"))
    shot = rollout(0, n=24)
    async with Queued(engine) as queued:
        await burst(http, router.url, [shot.body(i) for i in range(len(shot))])
    assert queued.most > SLOTS


async def test_an_engine_that_reports_no_cap_gets_every_request_at_once(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """vLLM reports no running cap: nothing is held unless --dispatch-slots says one."""
    vllm = EngineConfig(dp_size=2, limits=RankLimits(max_running=2), time_scale=0.3)
    (engine,) = (await start_cluster([vllm])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    body = {"prompt": "go", "max_tokens": 40, "ignore_eos": True}

    async def one() -> None:
        async with http.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 200

    async with Queued(engine) as queued:
        await asyncio.gather(*(one() for _ in range(8)))
    assert queued.most > 2  # the engine queued what it could not run
    router = await start_router(RouterConfig(workers=workers(engine.url), dispatch_slots=2))
    async with Queued(engine) as queued:
        await asyncio.gather(*(one() for _ in range(8)))
    assert queued.most == 2


async def test_a_request_sampling_n_waits_for_n_free_slots_on_one_rank(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Two ranks of 4 slots each run a request of n = 3 (``--samples together``: a
    request's samples on one rank): each has one slot free, and a request of n = 2 waits
    in the router (sent, it would queue on the rank behind the
    engine's cap) until a rank frees its slots, then goes there. (A stand-in engine
    answers, each request when told.)"""
    arrived: list[tuple[int, str]] = []  # (n, rank), in arrival order
    answer = {n: asyncio.Event() for n in (2, 3)}
    first = asyncio.Event()  # the first n = 3 request ends before the other

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        arrived.append((body["n"], request.headers["X-data-parallel-rank"]))
        if body["n"] == 3 and len(arrived) == 1:
            await first.wait()
        else:
            await answer[body["n"]].wait()
        return web.json_response({"choices": [], "usage": {"completion_tokens": 4}})

    async with serving(completions_engine(completions)) as url:
        stand_in = workers(url, dialect="vllm", dp_size=2)
        router = await start_router(
            RouterConfig(
                workers=stand_in, policy="least_load", dispatch_slots=SLOTS, samples="together"
            )
        )

        async def send(n: int) -> None:
            body = {"prompt": f"sample me {n}", "max_tokens": 4, "n": n}
            async with http.post(router.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()

        sent = [asyncio.create_task(send(3))]
        assert await until(lambda: len(arrived) == 1)
        sent.append(asyncio.create_task(send(3)))
        assert await until(lambda: len(arrived) == 2)
        sent.append(asyncio.create_task(send(2)))
        assert await until(lambda: held(router) == 1)
        await asyncio.sleep(0.1)
        assert len(arrived) == 2  # held: one slot free on each rank, two needed
        first.set()  # the first rank's three sequences end: its slots free
        assert await until(lambda: len(arrived) == 3)
        answer[3].set()
        answer[2].set()
        await asyncio.gather(*sent)
    (_, freed), (_, busy), (n, rank) = arrived
    assert busy != freed and (n, rank) == (2, freed), arrived
    assert held(router) == 0
    assert all(t.outstanding == 0 for t in router.registry.targets())


async def test_a_held_request_whose_client_leaves_never_reaches_the_engine(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([ATTENTION_DP])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    long = {"text": "long", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    running = [asyncio.create_task(generate(http, router.url, long)) for _ in range(2 * SLOTS)]
    assert await until(lambda: len(engine.received) == 2 * SLOTS)
    leaving = {"text": "leaves", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await generate(http, router.url, leaving)
    assert await until(lambda: held(router) == 0)
    await asyncio.gather(*running)
    assert all(r.body["text"] == "long" for r in engine.received)  # it never went
    after = {"text": "after", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    assert await generate(http, router.url, after) == 5  # and its slot was not lost
    assert await metric_sum(http, router.url, "dprouter_held_requests") == 0


async def test_a_request_held_too_long_gets_a_503_and_the_router_serves_on(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([ATTENTION_DP])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), dispatch_wait=0.2))
    long = {"text": "long", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    running = [asyncio.create_task(generate(http, router.url, long)) for _ in range(2 * SLOTS)]
    assert await until(lambda: len(engine.received) == 2 * SLOTS)
    async with http.post(router.url + "/generate", json=long) as r:
        assert r.status == 503
        message = (await r.json())["error"]["message"]
    assert "no rank had a free running slot within 0.2 s" in message
    await asyncio.gather(*running)
    assert await generate(http, router.url, long) == 200
    rejected = await metric_sum(http, router.url, "dprouter_rejected_total", cause="held_too_long")
    assert rejected == 1


async def test_a_group_is_predicted_by_its_first_samples_to_finish(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Samples of one prompt, with no exact length: once one has finished, the held
    siblings of a long group go before those of a short one."""
    (engine,) = (await start_cluster([ATTENTION_DP])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    # the simulator runs a prompt ending in eos=N to N tokens; the router cannot know
    short = {"text": "short group eos=4", "sampling_params": {"max_new_tokens": 400}}
    long = {"text": "long group eos=120", "sampling_params": {"max_new_tokens": 400}}
    for body in (short, long):  # each group seen once: its history
        await generate(http, router.url, body)
    blocker = {"text": "blocker", "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    running = [asyncio.create_task(generate(http, router.url, blocker)) for _ in range(2 * SLOTS)]
    assert await until(lambda: len(engine.received) == 2 + 2 * SLOTS)
    queued = [asyncio.create_task(generate(http, router.url, b)) for b in [short, long] * 4]
    assert await until(lambda: held(router) == 8)
    assert await metric_sum(http, router.url, "dprouter_held_requests") == 8
    await asyncio.gather(*running, *queued)
    order = [r.body["text"] for r in list(engine.received)[2 + 2 * SLOTS :]]
    assert order == [long["text"]] * 4 + [short["text"]] * 4


def _incoming(body: dict[str, Any], headers: dict[str, str] | None = None) -> Incoming:
    import orjson

    return parse(orjson.dumps(body), "generate", headers or {})


def test_predictions_exact_then_group_then_typical() -> None:
    estimate = OutputEstimate()
    exact = _incoming({"text": "a", "sampling_params": {"max_new_tokens": 90, "ignore_eos": True}})
    assert exact.exact and estimate.predict(exact) == 90
    floor = _incoming(
        {"text": "a", "sampling_params": {"max_new_tokens": 70, "min_new_tokens": 70}}
    )
    assert floor.exact and estimate.predict(floor) == 70
    capped = _incoming({"text": "a", "sampling_params": {"max_new_tokens": 500}})
    assert not capped.exact and estimate.predict(capped) == 500  # nothing seen yet: the cap
    estimate.observe(40, None, capped.group)
    estimate.observe(60, None, capped.group)
    assert estimate.predict(capped) == 50  # the group's mean so far
    other = _incoming({"text": "b", "sampling_params": {"max_new_tokens": 500}})
    assert estimate.predict(other) == 41  # another prompt: the typical length (40, then 60)
    named = _incoming(other.body, {"x-dprouter-group": "g1"})
    twin = _incoming(capped.body, {"x-dprouter-group": "g1"})
    assert named.group == twin.group != capped.group  # the client's group wins over the prompt


def test_a_slot_is_left_to_the_process_that_shows_the_better_first_in_line() -> None:
    """Two serving processes' views of one board (``proxy/heads.py``): each shows, per
    target, the key of its first in line; a request takes a slot only where no other
    process shows a better one (the class first, then the longer predicted; a tie: the
    lower row). A process that stopped looking is passed over once ``STALE``; one that
    died has its keys cleared."""
    buffer = bytearray(size_of(2, 4, 4))
    zero, one = (Board(rows=2, row=r, slots=4, buffer=buffer, tenants=4) for r in (0, 1))
    ranks = np.array([1, 2], dtype=np.intp)
    every = np.arange(4, dtype=np.intp)
    long, short, high = key(1, -500.0), key(1, -20.0), key(0, -20.0)
    assert high > long > short > 0  # the class first, then the longer
    assert key(1, 5e20) > 0 and key(9999, 0.0) > 0  # clamped: never "nothing"
    mine, theirs = Heads(), Heads()
    assert mine.others(zero) is None  # nothing held anywhere: nothing to compare
    theirs.show([(one, ranks, long)])  # process 1 holds a long request for ranks 1 and 2
    rows = mine.others(zero)
    assert rows == [1]
    assert mine.clear(zero, rows, every, short).tolist() == [True, False, False, True]
    assert mine.clear(zero, rows, ranks, high).tolist() == [True, True]  # a higher class
    assert mine.clear(zero, rows, ranks, long).tolist() == [True, True]  # a tie: row 0 first
    mine.show([(zero, ranks, long)])
    back = theirs.others(one)
    assert back == [0] and theirs.clear(one, back, ranks, long).tolist() == [False, False]
    one.looked[1] = stamp() - STALE - 1  # process 1 stopped looking (its loop is stuck)
    assert mine.others(zero) is None  # passed over: it holds nobody back
    theirs.show([(one, ranks, long)])  # unchanged, but a look: stamped again
    assert mine.others(zero) is not None
    zero.release(1)  # process 1 died: the parent clears its rows
    assert mine.others(zero) is None and not zero.own_heads[1].any()
