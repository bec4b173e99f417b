"""Assembling a router: ``build_app`` for the routes, ``Router`` to run one in-process.

Every component is passed in or made here from the configuration -- no
globals -- so two routers can run side by side in one process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from aiohttp import web

from dprouter.config import RouterConfig, sources, validate
from dprouter.core.errors import ConfigError, TokenizerError, error
from dprouter.core.log_filter import quiet_malformed
from dprouter.core.net import bind, check_backlog, url_of
from dprouter.core.types import Side
from dprouter.engines.kvevents import prompt
from dprouter.engines.kvevents.feed import Feed
from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.lookup import Lookup
from dprouter.engines.kvevents.metrics import KvCollector
from dprouter.fleet.board_lock import BoardLock
from dprouter.fleet.breakers import Breakers
from dprouter.fleet.membership import read_within
from dprouter.fleet.membership.moriio import Registration
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry, worker_from_spec
from dprouter.policies import Policy, make_policy, needs_tokens
from dprouter.policies.cache_aware import CacheAware
from dprouter.policies.manual import Manual
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.pd.pair import PairProxy
from dprouter.proxy.plain import Proxy
from dprouter.proxy.retry import Rules
from dprouter.proxy.routing_keys import Places, claims
from dprouter.proxy.upstream import upstream_session
from dprouter.server.admission import Admission, AdmissionOptions
from dprouter.server.engine_routes import Surface
from dprouter.server.parts import PARTS, Control, Parts
from dprouter.server.routes import Handlers

log = logging.getLogger("dprouter")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    config: RouterConfig,
    *,
    registry: Registry | None = None,
    policy: Policy | None = None,
    monitor: Monitor | None = None,
    control: Control | None = None,
    metrics_dir: str | None = None,
    lock: BoardLock | None = None,
) -> web.Application:
    """The router's routes. ``control`` makes it one serving process of several: the
    parent's control plane then runs discovery, breakers and admin, and ``monitor`` must
    be the one that follows it."""
    config = validate(config)
    if registry is None:
        registry = Registry(dp_aware=config.dp_aware != "off")
        for spec in config.workers:
            registry.add(worker_from_spec(spec, registry))
    parts = Parts(
        config=config,
        registry=registry,
        policy=policy or make_policy(config.policy_name, config.policy_options()),
        monitor=monitor or Monitor(registry, config.monitor_options()),
        metrics=RouterMetrics(registry, metrics_dir),
        breakers=Breakers(registry, config.breaker_options()),
        admission=Admission(
            AdmissionOptions(config.max_concurrent, config.queue_size, config.queue_timeout)
        ),
        control=control,
        lock=lock,
    )
    if needs_tokens(parts.policy):
        parts.lookup, parts.feed = prefix_parts(config, registry)
        parts.metrics.add(KvCollector(parts.feed))
    if control is None:
        parts.sources = sources(config, registry, parts.monitor)
    else:
        parts.breakers = control.breakers(config.breaker_options())
    parts.lag.on_tick = parts.metrics.loop_lag.set
    app = web.Application(client_max_size=config.max_body, middlewares=[_last_resort])
    app[PARTS] = parts
    app.cleanup_ctx.append(_lifecycle)
    app.add_routes([*Handlers(parts).routes(), *Surface(parts).routes()])
    if config.dashboard:
        from dprouter.server.dashboard import Dashboard

        dashboard = Dashboard(parts)
        app.add_routes(dashboard.routes())
        app.cleanup_ctx.append(dashboard.lifecycle)
    return app


def prefix_parts(config: RouterConfig, registry: Registry) -> tuple[Lookup, Feed]:
    """The index, the engines' events that build it and the tokenizers that look prompts
    up in it; the tokenizer files are read now, at start-up."""
    index = KvIndex(config.kv_capacity)
    pool = ThreadPoolExecutor(2, thread_name_prefix="tokenise")
    try:
        tokens = prompt.load(config.tokenizer_dirs(), pool, prompt.TOKENS_KEPT)
    except (TokenizerError, OSError, ValueError) as exc:
        pool.shutdown()
        raise ConfigError(f"cannot load a tokenizer: {exc}") from None
    return Lookup(tokens, index, pool), Feed(registry, index)


@web.middleware
async def _last_resort(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every answer is in OpenAI's error shape, a bug's too (and it is logged with its trace)."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error(404, f"no route {request.path}")
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return error(
            405,
            f"{request.method} is not allowed on {request.path}; use {allowed}",
            headers={"Allow": allowed},
        )
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error(500, "internal router error (logged)")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    parts = app[PARTS]
    config = parts.config
    session = upstream_session(config)
    if config.pd == "vllm-moriio" and parts.control is None:
        parts.registration = Registration(
            parts.registry, config.registration, config.heartbeat_timeout, parts.monitor.forget
        )
        await parts.registration.start()
    for source in parts.sources:
        await source.start()
    rules = Rules(
        session,
        parts.breakers,
        parts.metrics,
        parts.monitor.suspect,
        limit=config.attempts,
        backoff=config.retry_backoff,
        connect_timeout=config.connect_timeout,
        first_byte_timeout=config.first_byte_timeout,
        seed=config.seed,
        output_budget=config.output_budget,
        board=parts.registry.board,
    )
    if config.pd is not None:
        policies: dict[Side, Policy] = {
            side: make_policy(config.role_policy(side), config.policy_options())
            for side in ("prefill", "decode")
        }
        placers: dict[Side, Places] = {}
        for side, policy in policies.items():
            if not isinstance(policy, Manual):
                continue
            if parts.control is not None:
                placers[side] = parts.control.placer(policy, side)
            elif (claimed := claims(parts.sources, policy, side)) is not None:
                placers[side] = claimed
            if side in placers:
                policy.bound = 0  # the table's owner (the parent, etcd's claim) moves keys
        parts.proxy = PairProxy(
            config,
            parts.registry,
            policies["prefill"],
            policies["decode"],
            parts.metrics,
            rules,
            placers,
            parts.lock,
        )
    else:
        placer: Places | None = None
        if parts.control is not None and isinstance(parts.policy, Manual):
            placer = parts.control.placer(parts.policy, "regular")
        elif isinstance(parts.policy, Manual):
            placer = claims(parts.sources, parts.policy)
        if placer is not None and isinstance(parts.policy, Manual):
            parts.policy.bound = 0  # the table's owner (the parent, etcd's claim) moves keys
        if parts.control is not None and isinstance(parts.policy, CacheAware):
            parts.control.share_prefixes(parts.policy)
        parts.proxy = Proxy(
            config, parts.registry, parts.policy, parts.metrics, rules, placer, parts.lock
        )
        parts.proxy.lookup = parts.lookup
    if parts.feed is not None:
        await parts.feed.start()
    await parts.monitor.start()
    parts.lag.start()
    try:
        yield
    finally:
        await parts.lag.stop()
        if parts.registration is not None:
            await parts.registration.stop()
        for source in parts.sources:
            await source.stop()
        await parts.monitor.stop()
        if parts.feed is not None:
            await parts.feed.stop()
        if parts.lookup is not None:
            parts.lookup.close()
        parts.breakers.stop()
        await session.close()


class Router:
    """A router listening on loopback (or wherever the config says), in this process."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        registry: Registry | None = None,
        policy: Policy | None = None,
        monitor: Monitor | None = None,
        control: Control | None = None,
        metrics_dir: str | None = None,
        lock: BoardLock | None = None,
    ) -> None:
        self.app = build_app(
            config,
            registry=registry,
            policy=policy,
            monitor=monitor,
            control=control,
            metrics_dir=metrics_dir,
            lock=lock,
        )
        self.parts = self.app[PARTS]
        self.config = self.parts.config
        self.port = self.config.port
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._fd = -1  # the listening socket's

    @property
    def url(self) -> str:
        return url_of(self.config.host, self.port)

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
        self._site = web.SockSite(self._runner, sock)
        await self._site.start()

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
        if self._runner is not None:
            await self.parts.drain.run(self.config.grace)
            await self._runner.cleanup()
            self._runner = None

    async def settled(self, seconds: float) -> bool:
        """Wait for the membership sources' first read, then for discovery of every worker;
        False if some are still discovering."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        read = await read_within(self.parts.sources, seconds)
        return await self.monitor.settled_within(max(deadline - loop.time(), 0.0)) and read

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
