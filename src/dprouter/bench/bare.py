"""The floor of dprouter's HTTP stack: an aiohttp server forwarding to an aiohttp client.

No parsing, routing, rank, metrics or retries -- just the bytes through, the
way a minimal proxy would. The overhead scenario runs it beside dprouter so
the report separates what dprouter's own logic costs from what the stack it
is built on costs.

    python -m dprouter.bench.bare --port 20002 --upstream http://127.0.0.1:20001
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

DROP = frozenset({"host", "content-length", "connection", "transfer-encoding"})
SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(upstream: str) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        sent = {k: v for k, v in request.headers.items() if k.lower() not in DROP}
        answer = await request.app[SESSION].post(
            upstream + request.path, data=await request.read(), headers=sent
        )
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in DROP}
        if not answer.headers.get("Content-Type", "").startswith("text/event-stream"):
            body = await answer.read()
            answer.release()
            return web.Response(status=answer.status, body=body, headers=headers)
        resp = web.StreamResponse(status=answer.status, headers=headers)
        await resp.prepare(request)
        async for chunk in answer.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        answer.release()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    print("bare proxy ready", flush=True)
    web.run_app(
        make_app(args.upstream), host="127.0.0.1", port=args.port, print=None, access_log=None
    )


if __name__ == "__main__":
    main()
