"""``--metrics-port``: ``GET /metrics`` on a port of its own as well (the SGLang gateway's
``--prometheus-port``), for a scraper kept off the traffic port.

The same exposition as the router's own ``/metrics`` (which stays), and nothing else:
no admin call, no generation reaches the router through this port. Plain HTTP, as the
gateway's. Under ``--processes N`` every serving process listens on it (SO_REUSEPORT,
the port held by the parent as the main one is) and each answers for the whole router.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from dprouter.core.net import bind, url_of
from dprouter.proxy.metrics import RouterMetrics


class MetricsSite:
    """``/metrics`` alone on ``host:port`` (port 0: any free one; ``port`` says which)."""

    def __init__(self, metrics: RouterMetrics, host: str, port: int, shared: bool) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.shared = shared  # serving processes of --processes N share the port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return url_of(self.host, self.port) + "/metrics"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.answer)
        sock = bind(self.host, self.port, reuse_port=self.shared)
        self.port = sock.getsockname()[1]
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def answer(self, _: web.Request) -> web.Response:
        body = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
