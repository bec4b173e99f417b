"""Handlers of the engine surface beyond generation, one per routing of the endpoint
table (``endpoints.ENDPOINTS``): by the policy, to any worker, to the stored response's
target, or to every worker."""

from __future__ import annotations

from functools import partial
from importlib.metadata import version

from aiohttp import web

from dprouter.core.errors import error
from dprouter.fleet.targets import Worker
from dprouter.proxy.plain import Proxy
from dprouter.proxy.pools import no_pool
from dprouter.proxy.rankless import Rankless
from dprouter.server.endpoints import ENDPOINTS, Endpoint
from dprouter.server.parts import Parts
from dprouter.server.routes import guarded

P_D_ONLY = "a P/D router serves completions, chat and /generate only"


class EngineRoutes:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def routes(self) -> list[web.RouteDef]:
        handlers = {
            "policy": self.by_policy,
            "any": self.anyone,
            "stored": self.stored,
            "each": self.each,
        }
        routes = [web.route(e.method, e.path, partial(handlers[e.routing], e)) for e in ENDPOINTS]
        return [*routes, web.get("/version", self.version)]

    @property
    def rankless(self) -> Rankless:
        assert self.parts.rankless is not None  # made at start-up
        return self.parts.rankless

    async def by_policy(self, endpoint: Endpoint, request: web.Request) -> web.StreamResponse:
        proxy = self.parts.proxy
        if not isinstance(proxy, Proxy):  # a P/D router pairs generation only
            return error(404, P_D_ONLY)
        assert endpoint.kind is not None
        call = partial(proxy.handle, request, endpoint.kind, endpoint.dialect)
        return await guarded(self.parts, request, call)

    async def anyone(self, endpoint: Endpoint, request: web.Request) -> web.StreamResponse:
        call = partial(self.rankless.anyone, request, endpoint.kind, endpoint.dialect)
        return await guarded(self.parts, request, call)

    async def stored(self, endpoint: Endpoint, request: web.Request) -> web.StreamResponse:
        responses = self.parts.responses
        if responses is None:
            return error(404, P_D_ONLY)
        flow = responses.create if endpoint.kind is not None else responses.follow
        return await guarded(self.parts, request, partial(flow, request))

    async def each(self, endpoint: Endpoint, request: web.Request) -> web.Response:
        workers: list[Worker] | None = None
        named = request.query.get("worker")
        if named is not None:
            worker = self.parts.registry.workers.get(named)
            if worker is None:
                return error(404, f"no worker {named!r}", "worker")
            workers = [worker]

        def path(w: Worker) -> str | None:
            return endpoint.path if w.dialect in endpoint.engines else None

        rows = await self.rankless.fan(request, path, endpoint.method, workers)
        if not rows:
            return no_pool(self.parts.registry, self.parts.metrics, endpoint.dialect, endpoint.path)
        ok = all(r["status"] is not None and r["status"] < 300 for r in rows)
        return web.json_response({"workers": rows}, status=200 if ok else 502)

    async def version(self, request: web.Request) -> web.Response:
        """The router's version, and each ready worker's (SGLang tells it in server_info)."""

        def path(w: Worker) -> str:
            return "/server_info" if w.dialect == "sglang" else "/version"

        rows = await self.rankless.fan(request, path)
        for row in rows:
            body = row.pop("body", None)
            row["version"] = body.get("version") if isinstance(body, dict) else None
        return web.json_response({"version": version("dprouter"), "workers": rows})
