"""Passing requests through: streams, disconnects, failures, bad input."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.net import bind, url_of
from dprouter.sim.model.config import CostModel, EngineConfig, Faults
from tests.conftest import (
    StartCluster,
    StartRouter,
    completions_engine,
    metric_sum,
    serving,
    stalling,
    until,
    workers,
)
from tests.test_sim_vllm import sse_events

PROMPT = {"prompt": "pass me through", "max_tokens": 3}
# an upstream that splits SSE lines at odd places: the client must get the same bytes
PIECES = [b"da", b'ta: {"x": 1}\n', b"\ndata: {", b'"x": 2}\n\ndata: [DONE]\n\n']


@pytest.fixture
async def odd_upstream() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A plain aiohttp server speaking SSE in uneven pieces, the second held back
    until the test has seen the first arrive through the router."""
    release = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Up": "yes"})
        await resp.prepare(request)
        await resp.write(PIECES[0])
        await release.wait()
        for piece in PIECES[1:]:
            await resp.write(piece)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = completions_engine(stream)
    async with serving(app) as url:
        yield url, release


async def test_sse_passes_through_byte_exact_and_unbuffered(
    odd_upstream: tuple[str, asyncio.Event],
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    url, release = odd_upstream
    router = await start_router(RouterConfig(workers=workers(url, dialect="vllm", dp_size=1)))
    async with http.post(router.url + "/v1/completions", json={**PROMPT, "stream": True}) as r:
        assert r.headers["X-Up"] == "yes" and r.headers["x-dprouter-target"] == "w0"
        first = await asyncio.wait_for(r.content.read(2), 5)  # arrives before the rest exists
        release.set()
        rest = await r.read()
    assert first + rest == b"".join(PIECES)


async def test_client_disconnect_cancels_the_engine_request(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    body = {"prompt": "a long story", "max_tokens": 5000, "stream": True}
    resp = await http.post(router.url + "/v1/completions", json=body)
    await resp.content.readuntil(b"\n\n")
    rank = engine.engine.ranks[int(resp.headers["x-sim-dp-rank"])]
    target = next(t for t in router.registry.targets() if t.outstanding)
    assert rank.num_running == 1
    resp.close()
    for _ in range(200):
        if rank.num_running == 0 and target.outstanding == 0:
            break
        await asyncio.sleep(0.01)
    assert (rank.num_running, rank.stats.aborted, target.outstanding) == (0, 1, 0)
    assert rank.stats.generation_tokens < 5000


async def test_clients_closing_mid_stream_are_clients_that_left_not_cut_streams(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that closes its connection while a fast stream runs: its connection can be
    closing when the next event is written, a loop turn before the handler is cancelled.
    That write used to be taken for the engine cutting the stream (``stream_cut`` counted
    against the target, an "unexpected error" logged with its trace, a 500 to nobody)."""
    fast = EngineConfig(dp_size=2, cost=CostModel(step_base=1e-4, decode_per_seq=1e-6))
    (engine,) = (await start_cluster([fast])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    )
    body = b'{"prompt": "a long story", "max_tokens": 2000, "stream": true}'

    async def leave() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(head % len(body) + body)
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(200)  # the stream runs
        await asyncio.sleep(0.01)
        writer.close()
        await writer.wait_closed()

    for _ in range(20):  # 400 streams: the closing connection meets a write in a few
        await asyncio.gather(*(leave() for _ in range(20)))
    assert await until(lambda: all(t.outstanding == 0 for t in router.registry.targets()))
    assert await until(lambda: not any(r.num_running for r in engine.engine.ranks))
    async with http.get(router.url + "/metrics") as r:
        assert "stream_cut" not in await r.text()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_failed_attempts_are_retried_on_another_target(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    broken, good = (
        await start_cluster(
            [
                EngineConfig(faults=Faults(fail_rate=1.0)),
                EngineConfig(),
            ]
        )
    ).servers
    router = await start_router(RouterConfig(workers=workers(broken.url, good.url)))
    for _ in range(4):  # round robin sends each request to the broken one first
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200
            assert r.headers["x-sim-engine"] == good.engine_id
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    failures = 'dprouter_upstream_errors_total{cause="status_500",dp_rank="",role="regular",'
    assert failures + 'worker="w0"} 4.0' in text
    await good.crash()  # now nothing answers: a clear 502, and the router keeps serving
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 502
        assert "every attempt failed" in (await r.json())["error"]["message"]
    async with http.get(router.url + "/health") as r:
        assert r.status == 200


async def test_a_stream_cut_by_the_engine_ends_with_an_error_event(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    body = {"prompt": "cut", "max_tokens": 5000, "stream": True}
    async with http.post(router.url + "/v1/completions", json=body) as r:
        await r.content.readuntil(b"\n\n")
        await engine.crash()
        events = sse_events(await r.read())
    assert b"closed the stream before it finished" in events[-2]
    assert events[-1] == b"[DONE]"
    assert all(t.outstanding == 0 for t in router.registry.targets())


async def test_bad_input_gets_clear_errors(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url), max_body=4096))
    url = router.url + "/v1/completions"
    cases: list[tuple[bytes, dict[str, str], int, str]] = [
        (b"{oops", {}, 400, "Invalid JSON body"),
        (b'"text"', {}, 400, "must be a JSON object"),
        (b'{"prompt": "x", "stream": "yes"}', {}, 400, "stream must be true or false"),
        (b'{"prompt": "x", "max_tokens": "9"}', {}, 400, "max_tokens must be an integer"),
        (b'{"prompt": "x", "max_tokens": -1}', {}, 400, "max_tokens must be at least 1"),
        (b'{"prompt": 5}', {}, 400, "prompt must be a non-empty string or list"),
        (b'{"prompt": "x", "model": 3}', {}, 400, "model must be a string"),
        (b'{"prompt": "x"}', {"X-Session-ID": "k" * 600}, 400, "X-Session-ID must be 1 to 512"),
        (b'{"prompt": "' + b"x" * 5000 + b'"}', {}, 413, "exceeds 4096 bytes"),
    ]
    for raw, headers, status, needle in cases:
        async with http.post(url, data=raw, headers=headers) as r:
            assert r.status == status, raw[:40]
            err = (await r.json())["error"]
            assert needle in err["message"], (raw[:40], err)
    chat = router.url + "/v1/chat/completions"
    async with http.post(chat, json={"messages": "hi"}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
    async with http.post(router.url + "/generate", json={"text": "x"}) as r:
        assert r.status == 404  # no SGLang worker for SGLang's own endpoint, nor ever will be
        assert "no SGLang worker is configured" in (await r.json())["error"]["message"]
    assert not engine.received  # nothing bad reached the engine
    async with http.post(url, json=PROMPT) as r:
        assert r.status == 200  # and the router keeps serving


async def test_no_ready_worker_is_a_503(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    closed = bind("127.0.0.1", 0)
    url = url_of("127.0.0.1", closed.getsockname()[1])
    closed.close()  # nothing listens there
    router = await start_router(RouterConfig(workers=workers(url)), settle=False)
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 503
        assert "no ready worker" in (await r.json())["error"]["message"]
    async with http.get(router.url + "/readiness") as r:
        assert r.status == 503


async def test_two_routers_side_by_side_in_one_process(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=4)])).servers
    a = await start_router(RouterConfig(workers=workers(engine.url)))
    b = await start_router(RouterConfig(workers=workers(engine.url), policy="least_load"))
    for router in (a, b, a):
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200
    counts = [await metric_sum(http, x.url, "dprouter_requests_total") for x in (a, b)]
    assert counts == [2.0, 1.0]


async def test_engine_reported_load_steers_least_load(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig(dp_size=2)])).servers
    router = await start_router(
        RouterConfig(
            workers=workers(engine.url),
            policy="least_load",
            load_interval=0.05,
        )
    )

    async def busy() -> None:  # another client loads rank 0 behind the router's back
        body = {"prompt": "elsewhere", "max_tokens": 400}
        async with http.post(
            engine.url + "/v1/completions", json=body, headers={"X-data-parallel-rank": "0"}
        ) as r:
            await r.read()

    tasks = [asyncio.create_task(busy()) for _ in range(3)]
    try:
        for _ in range(100):
            if router.registry.targets()[0].reported == 3:
                break
            await asyncio.sleep(0.02)
        ranks = []
        for _ in range(3):
            async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
                ranks.append(r.headers["x-sim-dp-rank"])
        assert ranks == ["1", "1", "1"]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_refusing_worker_leaves_the_snapshot_and_returns_when_it_answers(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    flaky, steady = (
        await start_cluster([EngineConfig(dp_size=2), EngineConfig(dp_size=2)])
    ).servers
    router = await start_router(RouterConfig(workers=workers(flaky.url, steady.url)))
    await flaky.crash()
    for _ in range(6):
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200 and r.headers["x-sim-engine"] == steady.engine_id
    assert router.registry.workers["w0"].state == "discovering"
    assert [t.label for t in router.registry.snapshot.pool()] == ["w1/0", "w1/1"]
    await flaky.start()
    assert await router.settled(10)
    engines = set()
    for _ in range(4):
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            engines.add(r.headers["x-sim-engine"])
    assert engines == {flaky.engine_id, steady.engine_id}


async def test_a_hanging_engine_times_out_and_the_request_moves_on(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    hung, fine = (
        await start_cluster(
            [
                EngineConfig(faults=Faults(hang=True)),
                EngineConfig(),
            ]
        )
    ).servers
    router = await start_router(RouterConfig(workers=workers(hung.url, fine.url), read_timeout=0.3))
    async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200 and r.headers["x-sim-engine"] == fine.engine_id
    assert all(t.outstanding == 0 for t in router.registry.targets())


@pytest.fixture
async def misbehaving() -> AsyncIterator[str]:
    """An upstream whose answers break: a body cut short, a stream cut mid-event, a 429."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("prompt") == "busy":
            return web.json_response(
                {"error": "slow down"}, status=429, headers={"Retry-After": "3"}
            )
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream" if body.get("stream") else "application/json",
            }
        )
        if not body.get("stream"):
            resp.content_length = 1000  # promises more than it sends
        await resp.prepare(request)
        await resp.write(b'data: {"ok": 1}\n\ndata: {"choi' if body.get("stream") else b'{"id"')
        assert request.transport is not None
        request.transport.abort()
        return resp

    app = completions_engine(completions)
    async with serving(app) as url:
        yield url


async def test_broken_answers_are_retried_or_reported_cleanly(
    misbehaving: str,
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    (good,) = (await start_cluster([EngineConfig()])).servers
    both = await start_router(
        RouterConfig(
            workers=(*workers(misbehaving, dialect="vllm", dp_size=1), *workers(good.url)),
        )
    )
    async with http.post(both.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200 and r.headers["x-sim-engine"] == good.engine_id  # retried
    alone = await start_router(
        RouterConfig(workers=workers(misbehaving, dialect="vllm", dp_size=1))
    )
    async with http.post(alone.url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 502
        assert "answer broke off" in (await r.json())["error"]["message"]
    async with http.post(alone.url + "/v1/completions", json={**PROMPT, "stream": True}) as r:
        events = sse_events(await r.read())
    assert events[0] == b'{"ok": 1}'
    assert events[1] == b'{"choi'  # the half event, closed off...
    assert b"closed the stream before it finished" in events[2]  # ...then an error of its own
    assert events[3] == b"[DONE]"
    async with http.post(alone.url + "/v1/completions", json={"prompt": "busy"}) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "3"  # the engine's own answer


async def test_unknown_paths_and_methods_answer_in_openai_shape(
    start_cluster: StartCluster, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    async with http.get(router.url + "/v1/nothing") as r:
        assert r.status == 404
        assert (await r.json())["error"]["message"] == "no route /v1/nothing"
    async with http.get(router.url + "/v1/completions") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"
        assert (await r.json())["error"]["type"] == "invalid_request_error"


async def test_a_cookie_an_engine_sets_reaches_its_client_and_no_other(
    start_router: StartRouter,
) -> None:
    """The router is shared by many clients: it must keep no cookie jar of its own."""
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("Cookie"))
        resp = web.json_response({"choices": [{"text": "ok"}]})
        resp.set_cookie("engine_session", f"for-request-{len(seen)}")
        resp.set_cookie("engine_affinity", "a")  # a second Set-Cookie header
        return resp

    app = completions_engine(completions)
    async with serving(app) as url:
        # by host name: aiohttp's cookie jar ignores cookies from bare IP addresses
        named = url.replace("127.0.0.1", "localhost")
        router = await start_router(RouterConfig(workers=workers(named, dialect="vllm", dp_size=1)))
        answers = []
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {}, {"Cookie": "mine=1"}):  # three clients, by their cookies
                async with http.post(
                    router.url + "/v1/completions", json=PROMPT, headers=headers
                ) as r:
                    assert r.status == 200 and len(r.headers.getall("Set-Cookie")) == 2
                    answers.append(r.cookies["engine_session"].value)
    assert answers == ["for-request-1", "for-request-2", "for-request-3"]  # each its own
    assert seen == [None, None, "mine=1"]  # a client's cookie goes through, nobody else's


async def test_the_engine_sees_the_clients_accept_encoding_not_one_of_the_routers(
    start_router: StartRouter,
) -> None:
    """Answers pass through undecoded, so only a client that asked may get them compressed."""
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("Accept-Encoding"))
        return web.json_response({"choices": [{"text": "ok"}]})

    app = completions_engine(completions)
    async with serving(app) as url:
        router = await start_router(RouterConfig(workers=workers(url, dialect="vllm", dp_size=1)))
        async with aiohttp.ClientSession(skip_auto_headers=["Accept-Encoding"]) as http:
            for headers in ({}, {"Accept-Encoding": "gzip"}):
                async with http.post(
                    router.url + "/v1/completions", json=PROMPT, headers=headers
                ) as r:
                    assert r.status == 200
    assert seen == [None, "gzip"]


async def test_a_connection_that_does_not_open_in_time_is_tried_again_on_the_same_target(
    start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The only target stops accepting for a moment (as when a burst swamps the router, whose
    own backlog outlasts the connect timer): the first connect times out; the request never
    left, so the same target is tried again, and answers once."""
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((await request.json())["prompt"])
        return web.json_response({"choices": [{"text": "ok"}]})

    async with stalling(completions_engine(answer)) as engine:
        router = await start_router(
            RouterConfig(
                workers=workers(engine.url, dialect="vllm", dp_size=1),
                connect_timeout=0.5,
                retry_backoff=0.6,  # the next attempt starts after the engine accepts again
            )
        )
        await engine.stall(0.6)
        async with http.post(router.url + "/v1/completions", json=PROMPT) as r:
            assert r.status == 200, await r.text()
        assert seen == [PROMPT["prompt"]]  # it reached the engine once
        timeouts = await metric_sum(
            http, router.url, "dprouter_upstream_errors_total", cause="connect_timeout"
        )
        assert timeouts == 1
