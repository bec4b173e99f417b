"""Routes of a simulated engine other than generation itself, in its persona's set."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dprouter.sim.http import sglang_info
from dprouter.sim.http.auth import admin
from dprouter.sim.http.generation import handle

if TYPE_CHECKING:
    from dprouter.sim.http.server import SimServer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown paths and methods answer as FastAPI does in both real engines."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


class Endpoints:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def routes(self) -> list[web.RouteDef]:
        common = [
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.get("/sim/steps", self.steps),
        ]
        if self.server.persona.name == "vllm":
            return [
                *common,
                web.get("/metrics", self.metrics),
                web.get("/ping", self.ping),
                web.get("/version", self.version),
                web.post("/reset_prefix_cache", self.reset_cache),
                web.get("/kv_event_sources", self.kv_event_sources),
            ]
        return [
            *common,
            web.get("/server_info", self.server_info),
            web.get("/get_server_info", self.server_info),
            web.get("/v1/loads", self.loads),
            web.post("/generate", self.generate),
            web.get("/health_generate", self.ping),
            web.get("/model_info", self.model_info),
            web.get("/get_model_info", self.model_info),
            web.post("/abort_request", self.abort_request),
            # SGLang 0.5.23 answers /get_load with 404
            *([web.get("/get_load", self.get_load)] if self.server.config.legacy_sglang else []),
        ]

    async def health(self, _: web.Request) -> web.Response:
        after = self.server.config.faults.health_fail_after
        if after is not None and self.server.now_wall() >= after:
            return web.Response(status=503)
        return web.Response(status=200)

    async def models(self, _: web.Request) -> web.Response:
        config = self.server.config
        card = {
            "id": config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": self.server.persona.name,
            "root": config.model,
            "parent": None,
            "max_model_len": config.limits.max_model_len,
        }
        adapters = [  # as vLLM and SGLang list a loaded adapter: its base is its parent
            {**card, "id": name, "root": root, "parent": config.model}
            for name, root in self.server.adapters.roots.items()
        ]
        return web.json_response({"object": "list", "data": [card, *adapters]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await handle(self.server, request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await handle(self.server, request, "chat")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await handle(self.server, request, "generate")

    async def metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.server.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def steps(self, _: web.Request) -> web.Response:
        """The simulator's own: each rank's steps, of which decode and prefill steps (a
        real SGLang logs each decode step of each rank with ``--decode-log-interval 1``)."""
        ranks = [
            {
                "dp_rank": r.index,
                "steps": r.stats.steps,
                "decode_steps": r.stats.decode_steps,
                "prefill_steps": r.stats.prefill_steps,
                "busy_seconds": r.stats.busy_time,
            }
            for r in self.server.engine.ranks
        ]
        return web.json_response({"engine": self.server.engine_id, "ranks": ranks})

    async def ping(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": sglang_info.VERSION})

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response(sglang_info.server_info(self.server))

    async def loads(self, request: web.Request) -> web.Response:
        ranks = self.server.engine.ranks
        wanted = request.query.get("dp_rank")
        if wanted is not None:
            if not wanted.lstrip("-").isdigit():
                detail = [{"type": "int_parsing", "loc": ["query", "dp_rank"], "input": wanted}]
                return web.json_response({"detail": detail}, status=422)  # FastAPI's answer
            ranks = [r for r in ranks if r.index == int(wanted)]
        return web.json_response(sglang_info.loads(self.server, ranks))

    async def get_load(self, _: web.Request) -> web.Response:
        return web.json_response(sglang_info.old_loads(self.server.engine.ranks))

    async def model_info(self, _: web.Request) -> web.Response:
        config = self.server.config
        info = {
            "model_path": config.model,
            "tokenizer_path": config.model,
            "is_generation": True,
            "weight_version": self.server.weights.version,  # what an update set
        }
        return web.json_response(info)

    async def reset_cache(self, _: web.Request) -> web.Response:
        """vLLM's ``/reset_prefix_cache`` (SGLang's ``/flush_cache``: ``weights``)."""
        self.server.reset_prefix_cache()
        return web.Response(status=200)

    async def kv_event_sources(self, _: web.Request) -> web.Response:
        """vLLM: each rank's KV-event publisher config, ``{}`` with events off."""
        kv = self.server.kv
        return web.json_response(kv.sources() if kv is not None else {})

    @admin
    async def abort_request(self, request: web.Request) -> web.Response:
        """By rid, every rid starting with it (``prefix``), or all (``abort_all``)."""
        try:
            body = await request.json()
            rid, every, prefix = body.get("rid"), body.get("abort_all"), body.get("prefix")
        except (ValueError, AttributeError):
            return web.json_response({"error": "body must be a JSON object"}, status=400)
        self.server.abort_requests.append(rid if not every else "*")
        runner = self.server.runner
        if every:
            runner.abort_all()
        elif isinstance(rid, str) and prefix:
            runner.abort_prefix(rid)
        elif isinstance(rid, str):
            runner.abort_rid(rid)
        return web.Response(status=200)  # as SGLang: known or not
