"""A trivial, fast upstream for measuring what a router itself costs.

It answers at once: a small JSON completion, or 16 SSE chunks then ``[DONE]``;
``/metrics`` shows one vLLM ``engine`` label (so routers discover one rank)
and ``/server_info`` is absent, as on vLLM. ``/v1/traces`` takes OTLP/HTTP traces and
drops them.

    python -m dprouter.bench.harness.backend --port 0    # prints "ready URL" once it listens
"""

from __future__ import annotations

import argparse
import time

import orjson
from aiohttp import web

from dprouter.core.net import bind, url_of

CHUNKS = 16


def body(i: int) -> bytes:
    return orjson.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": "bench",
            "choices": [{"index": 0, "text": f" word{i}", "finish_reason": None}],
        }
    )


WHOLE = orjson.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "text": " hello world", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }
)
STREAM = b"".join(b"data: " + body(i) + b"\n\n" for i in range(CHUNKS)) + b"data: [DONE]\n\n"
METRICS = (
    b'vllm:num_requests_running{engine="0",model_name="bench"} 0.0\n'
    b'vllm:num_requests_waiting{engine="0",model_name="bench"} 0.0\n'
)


async def completions(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    if b'"stream":true' in raw.replace(b" ", b""):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in STREAM.split(b"\n\n")[:-1]:  # each event its own write, as engines do
            await resp.write(part + b"\n\n")
        await resp.write_eof()
        return resp
    return web.Response(body=WHOLE, content_type="application/json")


async def metrics(_: web.Request) -> web.Response:
    return web.Response(body=METRICS, content_type="text/plain")


async def ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def traces(request: web.Request) -> web.Response:
    """An OTLP/HTTP receiver that keeps nothing: where a router's traces go when their
    cost is measured (``bench overhead``)."""
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")


async def models(_: web.Request) -> web.Response:
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": "bench", "object": "model", "created": int(time.time())}],
        }
    )


def app() -> web.Application:
    a = web.Application()
    a.add_routes(
        [
            web.post("/v1/completions", completions),
            web.get("/metrics", metrics),
            web.get("/health", ok),
            web.get("/v1/models", models),
            web.post("/v1/traces", traces),
        ]
    )
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    sock = bind(args.host, args.port, backlog=4096)
    url = url_of(args.host, sock.getsockname()[1])

    def ready(*_: object) -> None:
        print(f"ready {url}", flush=True)

    web.run_app(app(), sock=sock, backlog=4096, access_log=None, print=ready)


if __name__ == "__main__":
    main()
