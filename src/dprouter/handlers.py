"""The router's own routes, as methods of one small class with a literal route table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from dprouter.admin import Admin
from dprouter.follower import AdminRelay
from dprouter.guard import guarded
from dprouter.openapi import describe
from dprouter.relay import error
from dprouter.surface import Surface
from dprouter.targets import Role

if TYPE_CHECKING:
    from dprouter.app import Parts


class Handlers:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.description = describe(dashboard=parts.config.dashboard)

    def routes(self) -> list[web.RouteDef]:
        p = self.parts
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
            *Surface(p).routes(),
            web.get("/metrics", self.metrics),
            web.get("/openapi.json", self.openapi),
            *(
                AdminRelay(p.control).routes()
                if p.control is not None
                else Admin(p.config, p.registry, p.monitor, p.sources).routes()
            ),
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
