"""Hostile clients on the wire: malformed HTTP, oversize headers, redirect attempts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.server.router import Router
from dprouter.sim.model.config import EngineConfig
from tests.conftest import StartCluster, StartRouter, serving, workers


async def exchange(router: Router, raw: bytes) -> bytes:
    """Send raw bytes on a fresh connection; the status line that comes back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()


@pytest.fixture
async def canary() -> AsyncIterator[tuple[str, list[str]]]:
    """A server that must never hear from the router: it records every request."""
    heard: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        heard.append(request.path)
        return web.Response(text="you should not be here")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    async with serving(app) as url:
        yield url, heard


async def test_malformed_and_oversize_requests_are_refused_and_serving_goes_on(
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    body = b'{"prompt": "x"}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 15\r\n"
    cases = {
        "header over 8 KiB": head + b"X-Big: " + b"a" * 9000 + b"\r\n\r\n" + body,
        "bare CR in a header": head + b"X-Evil: a\rInjected: yes\r\n\r\n" + body,
        "no colon": head + b"Not a header\r\n\r\n" + body,
        "garbage request line": b"\x16\x03\x01 nonsense\r\n\r\n",
    }
    for name, raw in cases.items():
        line = await exchange(router, raw)
        assert line.split(b" ")[1] == b"400", (name, line)  # aiohttp answers in HTTP/1.0
    assert engine.generation_requests == 0  # none of it reached the engine
    async with http.post(router.url + "/v1/completions", json={"prompt": "fine"}) as r:
        assert r.status == 200
    # logged as the client's fault, one line each, not as the router's error with a trace
    logged = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert not [r for r in logged if r.levelno >= logging.ERROR]
    assert not [r for r in logged if r.levelno >= logging.WARNING and r.exc_info]
    warned = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert len(warned) == 3 and all(m.startswith("malformed request from ") for m in warned)


async def test_no_client_input_makes_the_router_connect_elsewhere(
    canary: tuple[str, list[str]],
    start_cluster: StartCluster,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    url, heard = canary
    (engine,) = (await start_cluster([EngineConfig()])).servers
    router = await start_router(RouterConfig(workers=workers(engine.url)))
    where = url.removeprefix("http://")
    body = b'{"prompt": "where do you go"}'
    absolute = (
        f"POST {url}/v1/completions HTTP/1.1\r\nHost: {where}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    line = await exchange(router, absolute)  # absolute-form URI naming the canary
    assert line.startswith(b"HTTP/1.1 200")
    headers = {"Host": where, "X-Forwarded-Host": where, "Forwarded": f"host={where}"}
    async with http.post(
        router.url + "/v1/completions", json={"prompt": "again", "url": url}, headers=headers
    ) as r:
        assert r.status == 200
    async with http.post(router.url + f"/v1/completions?next={url}", json={"prompt": "q"}) as r:
        assert r.status == 200
    assert heard == [] and engine.generation_requests == 3
