"""Bare proxies on other Python HTTP stacks, and whether their clients cancel upstream.

Runs inside the stacks environment (``bench/stacks.py`` installs it), not
dprouter's: it imports only aiohttp, granian, pyreqwest, pyqwest and the
standard library. Like ``bare.py``, no parsing, routing or retries -- the bytes
through -- so that the CPU it spends is the floor of its stack.

    python stack_proxy.py --port P --upstream URL --client aiohttp|pyreqwest  # aiohttp server
    UPSTREAM=URL CLIENT=pyqwest granian --interface rsgi stack_proxy:app    # granian server
    python stack_proxy.py --cancel-check pyreqwest   # JSON: does a cancel reach the engine?
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

DROP = frozenset({"host", "content-length", "connection", "transfer-encoding"})
SSE = "text/event-stream"
# (status, headers, whole body or None, chunks of a stream or None)
Answer = tuple[int, list[tuple[str, str]], bytes | None, AsyncIterator[bytes] | None]


def _kept(items: Any) -> list[tuple[str, str]]:
    return [(k, v) for k, v in items if k.lower() not in DROP]


def client(name: str) -> Callable[[str, bytes], Any]:
    """``post(url, body)``: an async context manager yielding an ``Answer``."""
    if name == "aiohttp":
        session: list[aiohttp.ClientSession] = []

        @asynccontextmanager
        async def post_aiohttp(url: str, body: bytes) -> AsyncIterator[Answer]:
            if not session:
                connector = aiohttp.TCPConnector(limit=0)
                session.append(aiohttp.ClientSession(connector=connector, auto_decompress=False))
            hdrs = {"Content-Type": "application/json"}
            async with session[0].post(url, data=body, headers=hdrs) as r:
                kept = _kept(r.headers.items())
                if r.headers.get("Content-Type", "").startswith(SSE):
                    yield r.status, kept, None, r.content.iter_any()
                else:
                    yield r.status, kept, await r.read(), None

        return post_aiohttp
    if name == "pyreqwest":
        from pyreqwest.client import ClientBuilder

        built = ClientBuilder().gzip(False).brotli(False).zstd(False).deflate(False).build()

        @asynccontextmanager
        async def post_pyreqwest(url: str, body: bytes) -> AsyncIterator[Answer]:
            req = built.post(url).header("content-type", "application/json").body_bytes(body)
            async with req.build_streamed() as r:
                kept = _kept(r.headers.items())

                async def chunks() -> AsyncIterator[bytes]:
                    while (chunk := await r.body_reader.read_chunk()) is not None:
                        yield bytes(chunk)

                if (r.headers.get("content-type") or "").startswith(SSE):
                    yield r.status, kept, None, chunks()
                else:
                    yield r.status, kept, bytes(await r.body_reader.bytes()), None

        return post_pyreqwest
    from pyqwest import Headers, HTTPTransport, Request

    transport = HTTPTransport(enable_gzip=False, enable_brotli=False, enable_zstd=False)

    @asynccontextmanager
    async def post_pyqwest(url: str, body: bytes) -> AsyncIterator[Answer]:
        hdrs = Headers({"content-type": "application/json"})
        async with await transport.execute(Request("POST", url, hdrs, body)) as r:
            kept = _kept(r.headers.items())

            async def chunks() -> AsyncIterator[bytes]:
                async for chunk in r.content:
                    yield bytes(chunk)

            if r.headers.get("content-type", "").startswith(SSE):
                yield r.status, kept, None, chunks()
            else:
                yield r.status, kept, b"".join([c async for c in chunks()]), None

    return post_pyqwest


def aiohttp_app(upstream: str, name: str) -> web.Application:
    post = client(name)

    async def forward(request: web.Request) -> web.StreamResponse:
        async with post(upstream + request.path, await request.read()) as (status, h, body, it):
            if it is None:
                return web.Response(status=status, body=body, headers=h)
            resp = web.StreamResponse(status=status, headers=h)
            await resp.prepare(request)
            async for chunk in it:
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    return app


class RSGIApp:
    """The granian face: ``UPSTREAM`` and ``CLIENT`` come from the environment."""

    def __init__(self) -> None:
        self.upstream = os.environ.get("UPSTREAM", "")
        self.post = client(os.environ.get("CLIENT", "aiohttp"))

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        body = await proto()
        async with self.post(self.upstream + scope.path, body) as (status, h, whole, it):
            if it is None:
                proto.response_bytes(status, h, whole)
                return
            transport = proto.response_stream(status, h)
            async for chunk in it:
                await transport.send_bytes(chunk)


app = RSGIApp()


async def cancel_check(name: str) -> dict[str, Any]:
    """An engine that takes 3 s to answer; the caller gives up after 0.3 s. Did the engine
    see the connection close (so that a real one would stop generating)?"""
    seen: list[str] = []
    heard = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(3)
            seen.append("finished")
        except asyncio.CancelledError:
            seen.append("disconnect")
            raise
        finally:
            heard.set()
        return web.Response(text="late")

    engine = web.Application()
    engine.router.add_post("/v1/completions", slow)
    runner = web.AppRunner(engine, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
    post = client(name)

    async def call() -> None:
        async with post(url, b"{}"):
            pass

    task = asyncio.create_task(call())
    await asyncio.sleep(0.3)
    task.cancel()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(heard.wait(), 4)  # the engine answers at 3 s at the latest
    await runner.cleanup()
    return {"client": name, "engine_saw": seen[0] if seen else "nothing"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    parser.add_argument("--upstream")
    parser.add_argument("--client", default="aiohttp")
    parser.add_argument("--cancel-check")
    args = parser.parse_args()
    if args.cancel_check:
        print(json.dumps(asyncio.run(cancel_check(args.cancel_check))))
        return
    print("ready", flush=True)
    web.run_app(
        aiohttp_app(args.upstream, args.client),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
