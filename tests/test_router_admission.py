"""Admission control: a cap on requests in flight, a bounded queue, a 429 beyond it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.server.admission import Admission, AdmissionOptions
from tests.conftest import StartRouter, completions_engine, serving, until, workers


@dataclass
class Held:
    """An upstream that holds every request until ``release`` is set."""

    url: str = ""
    seen: list[int] = field(default_factory=list)  # the "n" of each request, in arrival order
    release: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def held() -> AsyncIterator[Held]:
    state = Held()

    async def complete(request: web.Request) -> web.Response:
        state.seen.append((await request.json())["n"])
        await state.release.wait()
        return web.json_response({"choices": [{"text": "ok"}]})

    app = completions_engine(complete)
    async with serving(app) as url:
        state.url = url
        yield state


def config(upstream: str, **options: object) -> RouterConfig:
    return RouterConfig(workers=workers(upstream, dialect="vllm", dp_size=1), **options)  # type: ignore[arg-type]


async def test_beyond_the_cap_requests_queue_in_order_and_beyond_the_queue_get_429(
    held: Held, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_router(config(held.url, max_concurrent=2, queue_size=2))

    async def send(n: int) -> tuple[int, dict[str, object], str | None]:
        async with http.post(router.url + "/v1/completions", json={"prompt": "wait", "n": n}) as r:
            return r.status, await r.json(), r.headers.get("Retry-After")

    first = [asyncio.create_task(send(n)) for n in (0, 1)]
    assert await until(lambda: len(held.seen) == 2)
    queued = [asyncio.create_task(send(n)) for n in (2, 3)]
    admission = router.parts.admission
    assert await until(lambda: admission.waiting == 2)
    status, body, retry = await send(4)  # cap and queue both full: refused at once
    assert (status, retry) == (429, "1")
    assert body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert "capacity" in body["error"]["message"]  # type: ignore[index]
    assert held.seen == [0, 1]  # the queued ones have not reached the engine
    held.release.set()
    answers = await asyncio.gather(*first, *queued)
    assert [a[0] for a in answers] == [200] * 4
    assert held.seen == [0, 1, 2, 3]  # queued requests went on first come, first served
    assert (admission.active, admission.waiting) == (0, 0)
    async with http.get(router.url + "/metrics") as r:
        assert 'dprouter_rejected_total{cause="overloaded"} 1.0' in await r.text()


async def test_a_queued_request_times_out_with_a_429(
    held: Held, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_router(config(held.url, max_concurrent=1, queue_timeout=0.2))
    running = asyncio.create_task(
        http.post(router.url + "/v1/completions", json={"prompt": "wait", "n": 0})
    )
    assert await until(lambda: held.seen == [0])
    async with http.post(router.url + "/v1/completions", json={"prompt": "wait", "n": 1}) as r:
        assert (r.status, r.headers["Retry-After"]) == (429, "1")
        assert "within 0.2 s" in (await r.json())["error"]["message"]
    held.release.set()
    answer = await running
    assert answer.status == 200 and held.seen == [0]
    answer.release()


async def test_a_client_that_leaves_the_queue_frees_no_slot_twice(
    held: Held, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_router(config(held.url, max_concurrent=1, queue_size=4))
    admission = router.parts.admission
    running = asyncio.create_task(
        http.post(router.url + "/v1/completions", json={"prompt": "wait", "n": 0})
    )
    assert await until(lambda: held.seen == [0])
    leaving = asyncio.create_task(
        http.post(router.url + "/v1/completions", json={"prompt": "wait", "n": 1})
    )
    assert await until(lambda: admission.waiting == 1)
    leaving.cancel()  # the client hangs up while queued
    assert await until(lambda: admission.waiting == 0)
    held.release.set()
    (await running).release()
    async with http.post(router.url + "/v1/completions", json={"prompt": "wait", "n": 2}) as r:
        assert r.status == 200
    assert held.seen == [0, 2] and (admission.active, admission.waiting) == (0, 0)


async def test_no_cap_by_default() -> None:
    admission = Admission(AdmissionOptions(limit=0, queue=0, wait=30.0))
    assert [await admission.enter() for _ in range(10_000)] == [None] * 10_000
    assert admission.active == 10_000


async def test_a_freed_slot_goes_to_the_longest_waiter_not_a_newcomer() -> None:
    admission = Admission(AdmissionOptions(limit=1, queue=1, wait=5))
    assert await admission.enter() is None
    waiter = asyncio.create_task(admission.enter())
    assert await until(lambda: admission.waiting == 1)
    admission.leave()  # handed over: a newcomer now finds the cap full and the queue empty
    assert admission.active == 1 and admission.waiting == 0
    assert await waiter is None
    newcomer = asyncio.create_task(admission.enter())
    assert await until(lambda: admission.waiting == 1)
    admission.leave()
    assert await newcomer is None
    admission.leave()
    assert admission.active == 0
