"""``Router``: one router listening in this process, over the app ``build_app`` makes."""

from __future__ import annotations

import asyncio
import logging
import ssl

from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.log_filter import quiet_malformed
from dprouter.core.net import bind, check_backlog, url_of
from dprouter.core.service import Service
from dprouter.core.tls import https, reload, server_context
from dprouter.fleet.membership import settled
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry
from dprouter.server.app import build_app
from dprouter.server.metrics_site import MetricsSite
from dprouter.server.parts import PARTS

log = logging.getLogger("dprouter")


class Router(Service):
    """A router listening on loopback (or wherever the config says), in this process."""

    def __init__(self, config: RouterConfig) -> None:
        self._take(build_app(config))

    @classmethod
    def of(cls, app: web.Application) -> Router:
        """A router over an app ``build_app`` made with components of its own (a serving
        process of several makes its so)."""
        router = cls.__new__(cls)
        router._take(app)
        return router

    def _take(self, app: web.Application) -> None:
        self.app = app
        self.parts = self.app[PARTS]
        self.config = self.parts.config
        self.port = self.config.port
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._fd = -1  # the listening socket's
        self.metrics_site: MetricsSite | None = None  # --metrics-port: /metrics there too
        # HTTPS: one context for the router's life, its certificate reloaded in place
        self.tls: ssl.SSLContext | None = None
        if self.config.tls_cert is not None and self.config.tls_key is not None:
            self.tls = server_context(self.config.tls_cert, self.config.tls_key)

    @property
    def url(self) -> str:
        return https(url_of(self.config.host, self.port), self.tls is not None)

    @property
    def metrics_url(self) -> str | None:
        """Where ``--metrics-port`` serves ``/metrics``; None without it."""
        return self.metrics_site.url if self.metrics_site is not None else None

    def reload_tls(self) -> bool:
        """Load the certificate and key again (SIGHUP): new handshakes get the new pair,
        open connections keep theirs; a pair that does not load is logged and the old one
        stays (False)."""
        cert, key = self.config.tls_cert, self.config.tls_key
        if self.tls is None or cert is None or key is None:
            log.warning("TLS reload asked for, but the router serves plain HTTP")
            return False
        return reload(self.tls, cert, key)

    @property
    def registry(self) -> Registry:
        return self.parts.registry

    @property
    def monitor(self) -> Monitor:
        return self.parts.monitor

    async def start(self) -> None:
        for warning in (*self.config.warnings, check_backlog(self.config.backlog)):
            if warning:
                log.warning(warning)
        quiet_malformed()
        # serving processes of --processes N share the port (the kernel spreads connections)
        shared = self.parts.control is not None
        sock = bind(self.config.host, self.port, self.config.backlog, reuse_port=shared)
        self.port = sock.getsockname()[1]
        self._fd = sock.fileno()
        # a client that leaves cancels its handler, which closes the upstream request;
        # stopping closes the listener first, then gives in-flight requests the grace period
        # (``Drain``); aiohttp's own shutdown then finds them done
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        self._site = web.SockSite(self._runner, sock, ssl_context=self.tls)
        await self._site.start()
        if self.config.metrics_port is not None:
            host = self.config.metrics_host or self.config.host
            site = MetricsSite(self.parts.metrics, host, self.config.metrics_port, shared)
            await site.start()
            self.metrics_site = site

    async def stop(self) -> None:
        """Stop listening; requests in flight get ``config.grace`` seconds, then are cut
        (``parts.drain.cut`` counts them)."""
        if self._site is not None:
            # Stop accepting first, and let the connections just accepted get their transport
            # before the listener closes: asyncio sets a connection up in a task one loop turn
            # after accept(), and that task fails if the server has closed meanwhile, leaving
            # the socket open with nobody reading it (the client hangs until its timeout).
            asyncio.get_running_loop().remove_reader(self._fd)
            for _ in range(3):
                await asyncio.sleep(0)
            await self._site.stop()
            self._site = None
            # then let the handlers of those connections start: aiohttp's shutdown closes idle
            # connections, but one whose handler has not begun waiting misses that close
            for _ in range(3):
                await asyncio.sleep(0)
        if self.metrics_site is not None:
            await self.metrics_site.stop()
            self.metrics_site = None
        if self._runner is not None:
            await self.parts.drain.run(self.config.grace)
            await self._runner.cleanup()
            self._runner = None

    async def settled(self, seconds: float) -> bool:
        """Wait for the membership sources' first read, then for discovery of every worker;
        False if some are still discovering."""
        return await settled(self.parts.sources, self.monitor, seconds)
