"""The live view: ``/dashboard`` (a page with no build step) and ``/dashboard/data``.

Off unless ``--dashboard``. It names worker URLs, so with an admin token set the
page and its data need it: ``Authorization: Bearer <token>``, or Basic auth with
the token as the password, which is what lets a browser log in at all.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import time
from collections.abc import AsyncIterator
from importlib import metadata, resources

import orjson
from aiohttp import web

from dprouter.core.errors import error
from dprouter.policies.manual import Manual
from dprouter.server.admin import bearer
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


def authorised(token: str | None, header: str) -> bool:
    if token is None:
        return True
    if bearer(token, header):
        return True
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        _, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(password.encode(), token.encode())  # any user name


class Dashboard:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.token = parts.config.admin_token
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

    def denied(self, request: web.Request) -> web.Response | None:
        if authorised(self.token, request.headers.get("Authorization", "")):
            return None
        return error(
            401,
            "the dashboard needs the admin token (Bearer, or Basic with it as the password)",
            headers={"WWW-Authenticate": 'Basic realm="dprouter", charset="UTF-8"'},
        )

    async def page(self, request: web.Request) -> web.Response:
        return await self.file(request, "index.html")

    async def file(self, request: web.Request, name: str | None = None) -> web.Response:
        if (refused := self.denied(request)) is not None:
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
        if (refused := self.denied(request)) is not None:
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
