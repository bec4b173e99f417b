"""The router's own routes, as methods of one small class with a literal route table, and
what every routed request passes first (``guarded``): the drain (a stopping router
refuses), the front door (who sent it, their tenant's limits: ``door``) and admission (a
router at capacity answers 429), held until its last byte."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from dprouter.core.errors import error, grace_over
from dprouter.core.tracing import Tracing
from dprouter.core.types import Caller, Kind, Role
from dprouter.proxy.relay import STREAMING
from dprouter.server.openapi import describe
from dprouter.server.parts import Parts

STOPPING = {"Retry-After": "1"}  # and Connection: close (see closing)
STOPPED = "the router is stopping; retry"
Call = Callable[[], Awaitable[web.StreamResponse]]


async def guarded(parts: Parts, request: web.Request, call: Call | Kind) -> web.StreamResponse:
    """``call``: what answers, or the kind of request the proxy answers (the hot paths
    name it rather than pass a partial)."""
    p = parts
    tracing = p.tracing
    if p.drain.draining:  # a kept-alive connection's next request, after SIGTERM
        p.metrics.rejected.labels("stopping").inc()
        return tracing.answered(request, closing(error(503, STOPPED, headers=STOPPING)))
    task = p.drain.enter()
    try:
        with tracing.request(request, call if isinstance(call, str) else "engine"):
            started = tracing.clock()
            entry = await p.door.enter(request)
            if isinstance(entry, web.Response):
                admission(tracing, request, started, None, entry.status)
                return tracing.answered(request, entry)
            try:
                refused = await p.admission.enter()
                if refused is not None:
                    admission(tracing, request, started, entry.caller, 429)
                    p.metrics.rejected.labels("overloaded").inc()
                    message = f"the router is at capacity ({refused}); retry later"
                    answer = error(429, message, headers={"Retry-After": "1"})
                    return tracing.answered(request, answer)
                admission(tracing, request, started, entry.caller, "admitted")
                try:  # a stream holds its slot until its last byte
                    if isinstance(call, str):
                        assert p.proxy is not None
                        return await p.proxy.handle(request, call)
                    return await call()
                finally:
                    p.admission.leave()
            finally:
                p.door.leave(entry)  # its tenant's place in flight
    except asyncio.CancelledError as exc:
        if not grace_over(exc):
            raise  # the client left
        if task is not None:
            task.uncancel()
        begun: web.StreamResponse | None = request.get(STREAMING)
        if begun is not None:  # its last words are written
            return begun
        message = "the router stopped: its grace period ran out before the engine answered"
        return tracing.answered(request, closing(error(503, message, headers=STOPPING)))
    finally:
        p.drain.leave(task)


def admission(
    tracing: Tracing,
    request: web.Request,
    started: int,
    caller: Caller | None,
    outcome: str | int,
) -> None:
    """The admission span: the front door and the --max-concurrent queue, who the caller
    was (None: refused before it was known) and how it ended. Off: nothing is built."""
    if not tracing.on:
        return
    said: dict[str, str | int | float] = {"dprouter.outcome": outcome}
    if caller is not None:
        said |= {"dprouter.tenant": caller.tenant, "dprouter.class": caller.priority}
    tracing.admission(request, started, said)


def closing(resp: web.Response) -> web.Response:
    resp.force_close()  # the client opens a new connection: to a router that listens
    return resp


class Routes:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.description = describe(dashboard=parts.config.dashboard)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.post("/generate", self.generate),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),
            web.get("/health", self.health),
            web.get("/readiness", self.readiness),
            web.get("/ping", self.readiness),  # SageMaker's name for it
            web.post("/ping", self.readiness),
            web.get("/metrics", self.metrics),
            web.get("/openapi.json", self.openapi),
        ]

    # each routed path calls ``guarded`` itself: no intermediate coroutine, no partial
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await guarded(self.parts, request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await guarded(self.parts, request, "chat")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await guarded(self.parts, request, "generate")

    async def models(self, _: web.Request) -> web.Response:
        cards = list(self.parts.registry.snapshot.model_cards().values())
        return web.json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        card = self.parts.registry.snapshot.model_cards().get(name)
        if card is None:
            return error(404, f"The model `{name}` does not exist.", "model")
        return web.json_response(card)

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readiness(self, _: web.Request) -> web.Response:
        if self.parts.drain.draining:
            return error(503, "the router is stopping")
        snapshot = self.parts.registry.snapshot
        roles: tuple[Role, ...] = ("prefill", "decode") if self.parts.config.pd else ("regular",)
        if all(snapshot.pool(role) for role in roles):
            return web.json_response({"status": "ready"})
        return error(503, f"no ready worker yet for {' and '.join(roles)}")

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(self.description)

    async def metrics(self, _: web.Request) -> web.Response:
        body = self.parts.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
