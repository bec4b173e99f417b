"""What every routed request passes first: the drain (a stopping router refuses) and
admission (a router at capacity answers 429), held until its last byte is sent."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from dprouter.drain import grace_over
from dprouter.parse import Kind
from dprouter.relay import STREAMING, error

if TYPE_CHECKING:
    from dprouter.app import Parts

STOPPING = {"Retry-After": "1"}  # and Connection: close (see closing)
Call = Callable[[], Awaitable[web.StreamResponse]]


async def guarded(parts: Parts, request: web.Request, call: Call | Kind) -> web.StreamResponse:
    """``call``: what answers, or the kind of request the proxy answers (the hot paths
    name it rather than pass a partial)."""
    p = parts
    if p.drain.draining:  # a kept-alive connection's next request, after SIGTERM
        p.metrics.rejected.labels("stopping").inc()
        return closing(error(503, "the router is stopping; retry", headers=STOPPING))
    task = p.drain.enter()
    try:
        refused = await p.admission.enter()
        if refused is not None:
            p.metrics.rejected.labels("overloaded").inc()
            message = f"the router is at capacity ({refused}); retry later"
            return error(429, message, headers={"Retry-After": "1"})
        try:  # a stream holds its slot until its last byte
            if isinstance(call, str):
                assert p.proxy is not None
                return await p.proxy.handle(request, call)
            return await call()
        finally:
            p.admission.leave()
    except asyncio.CancelledError as exc:
        if not grace_over(exc):
            raise  # the client left
        if task is not None:
            task.uncancel()
        begun: web.StreamResponse | None = request.get(STREAMING)
        if begun is not None:  # its last words are written
            return begun
        message = "the router stopped: its grace period ran out before the engine answered"
        return closing(error(503, message, headers=STOPPING))
    finally:
        p.drain.leave(task)


def closing(resp: web.Response) -> web.Response:
    resp.force_close()  # the client opens a new connection: to a router that listens
    return resp
