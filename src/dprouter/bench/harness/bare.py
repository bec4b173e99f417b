"""The floor of dprouter's HTTP stack: an aiohttp server forwarding to an aiohttp client.

No parsing, routing, rank, metrics or retries -- just the bytes through, the
way a minimal proxy would. The overhead scenario runs it beside dprouter so
the report separates what dprouter's own logic costs from what the stack it
is built on costs.

    python src/dprouter/bench/harness/bare.py --port 0 --upstream http://127.0.0.1:20001

Run as a file, it imports aiohttp alone (``python -m`` would load the dprouter
package too, and its memory would count against the floor). It prints
``bare proxy ready URL`` once it listens (port 0: any free port).
"""

from __future__ import annotations

import argparse
import socket

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
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)  # aiohttp's default backlog, as before
    print(f"bare proxy ready http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(make_app(args.upstream), sock=sock, print=None, access_log=None)


if __name__ == "__main__":
    main()
