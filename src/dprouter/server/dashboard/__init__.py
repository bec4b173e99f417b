"""The live view: ``/dashboard`` (a page with no build step) and ``/dashboard/data``.

Off unless ``--dashboard``. It names worker URLs, so it is the admin's (``Identity.admin``):
with an admin credential configured (``--admin-token``, an admin API key, JWTs) the page
and its data need one, as ``Authorization: Bearer <credential>`` or as the password of
Basic auth, which is what lets a browser log in at all; with none, it answers loopback
and ``--admin-from`` networks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from importlib import metadata, resources

import orjson
from aiohttp import web

from dprouter.core.errors import error
from dprouter.policies.manual import Manual
from dprouter.server.dashboard.data import RouterInfo, build
from dprouter.server.dashboard.window import Window, read
from dprouter.server.parts import Parts

# the page loads only what the router serves, runs no inline script and posts nowhere
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
FILES = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "icon.svg": "image/svg+xml",
}


class Dashboard:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.window = Window(lambda: read(parts.metrics.whole(), time.monotonic()))
        self.started = time.time()
        self.version = metadata.version("dprouter")
        here = resources.files(__package__)
        self.files = {name: (here / name).read_bytes() for name in FILES}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/dashboard", self.page),
            web.get("/dashboard/data", self.data),
            web.get("/dashboard/{name}", self.file),
        ]

    async def lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(self.window.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def denied(self, request: web.Request) -> web.Response | None:
        refused = await self.parts.identity.admin(request, basic=True)
        if refused is not None and refused.status == 401:  # a browser asks for it
            refused.headers["WWW-Authenticate"] = 'Basic realm="dprouter", charset="UTF-8"'
        return refused

    async def page(self, request: web.Request) -> web.Response:
        return await self.file(request, "index.html")

    async def file(self, request: web.Request, name: str | None = None) -> web.Response:
        if (refused := await self.denied(request)) is not None:
            return refused
        name = name or request.match_info["name"]
        if name not in FILES:
            return error(404, f"no route {request.path}")
        headers = {
            "Content-Security-Policy": POLICY,
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache",
        }
        return web.Response(body=self.files[name], content_type=FILES[name], headers=headers)

    async def data(self, request: web.Request) -> web.Response:
        if (refused := await self.denied(request)) is not None:
            return refused
        config = self.parts.config
        sessions, started = await self._held()
        info = RouterInfo(
            version=self.version,
            uptime=time.time() - started,
            processes=self.parts.control.processes if self.parts.control else 1,
            policy=config.policy_name,
            pd=config.pd,
            discovery=discovery_source(config.discovery, config.pd),
            sessions=sessions,
            held=self.parts.metrics.held_now(),
        )
        body = orjson.dumps(build(self.parts.registry, self.window, info))
        headers = {"Cache-Control": "no-store"}
        return web.Response(body=body, content_type="application/json", headers=headers)

    async def _held(self) -> tuple[int, float]:
        """Routing keys held, and when the router started."""
        if self.parts.control is not None:
            return await self.parts.control.held() or (0, self.started)
        policy = self.parts.policy
        return (len(policy.sticky) if isinstance(policy, Manual) else 0), self.started


def discovery_source(discovery: str | None, pd: str | None) -> str:
    if discovery is not None:
        return "k8s" if discovery == "k8s" else "etcd"
    return "moriio" if pd == "vllm-moriio" else "static"
