"""Assembling a router: ``build_app`` makes its components and routes; ``router.Router``
runs one in-process.

Every component is passed in or made here from the configuration -- no
globals -- so two routers can run side by side in one process.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from aiohttp import web

from dprouter.config import RouterConfig, sources, validate
from dprouter.core.errors import ConfigError, TokenizerError, error
from dprouter.core.tls import EngineAccess
from dprouter.core.tracing import Tracing
from dprouter.core.types import Role
from dprouter.engines.kvevents import prompt
from dprouter.engines.kvevents.feed import Feed
from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.lookup import Lookup
from dprouter.engines.kvevents.metrics import KvCollector
from dprouter.fleet.board_lock import BoardLock
from dprouter.fleet.breakers import Breakers
from dprouter.fleet.membership.moriio import Registration
from dprouter.fleet.model_lists import ModelLists
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry, worker_from_spec
from dprouter.fleet.targets import Worker
from dprouter.policies import Policy, make_policy, needs_tokens
from dprouter.policies.cache_aware import CacheAware
from dprouter.policies.manual import Manual
from dprouter.proxy.abort import Aborter
from dprouter.proxy.dispatch import Dispatcher, DispatchOptions
from dprouter.proxy.limiter import Limiter
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.output_budget import OutputEstimate
from dprouter.proxy.parts import ProxyParts
from dprouter.proxy.pd.pair import SIDES, PairProxy
from dprouter.proxy.plain import Proxy
from dprouter.proxy.rankless import Rankless
from dprouter.proxy.responses import Responses
from dprouter.proxy.retry import Retry
from dprouter.proxy.routing_keys import Places, claims
from dprouter.proxy.upstream import Upstream, upstream_session
from dprouter.server.admin import Admin
from dprouter.server.admission import Admission, AdmissionOptions
from dprouter.server.door import Door
from dprouter.server.engine_routes import EngineRoutes
from dprouter.server.identity import Identity
from dprouter.server.parts import PARTS, Control, Parts
from dprouter.server.routes import Routes

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
    # one TLS context and key for every call to an engine, made once
    access = config.engine_access()
    if registry is None:
        registry = Registry(dp_aware=config.dp_aware != "off")
        for spec in config.workers:
            registry.add(worker_from_spec(spec, registry))
    metrics = RouterMetrics(registry, metrics_dir, classes=config.classes)
    # the keys and JWTs it takes; a serving process of --processes N leaves the start-up
    # warning to the parent
    identity = Identity.of(config, warn=control is None)
    parts = Parts(
        config=config,
        registry=registry,
        policy=policy or make_policy(config.policy_name, config.policy_options()),
        monitor=monitor or Monitor(registry, config.monitor_options(), access),
        metrics=metrics,
        breakers=Breakers(registry, config.breaker_options()),
        admission=Admission(
            AdmissionOptions(config.max_concurrent, config.queue_size, config.queue_timeout)
        ),
        door=door(identity, registry, metrics),
        tracing=Tracing(config.tracing),
        identity=identity,
        access=access,
        control=control,
        lock=lock,
    )
    if reads_prefixes(config, parts.policy):
        parts.lookup, parts.feed = prefix_parts(config, registry, access)
        parts.metrics.add(KvCollector(parts.feed))
    if control is None:
        parts.sources = sources(config, registry, parts.monitor)
        parts.lists = ModelLists(registry, config.list_options(), access)
    else:
        parts.breakers = control.breakers(config.breaker_options())
        parts.response_ids = control.response_ids()
    parts.lag.on_tick = parts.metrics.loop_lag.set
    app = web.Application(client_max_size=config.max_body, middlewares=[_last_resort])
    app[PARTS] = parts
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(identity.lifecycle)
    app.add_routes([*Routes(parts).routes(), *EngineRoutes(parts).routes()])
    if control is not None:
        app.add_routes(control.admin_routes())  # the parent runs them, once for all
    else:
        admin = Admin(config, registry, parts.monitor, parts.sources, identity=identity)
        app.add_routes(admin.routes())
        app.on_cleanup.append(lambda _: admin.close())
    if config.dashboard:
        from dprouter.server.dashboard import Dashboard  # its files and window only when asked for

        dashboard = Dashboard(parts)
        app.add_routes(dashboard.routes())
        app.cleanup_ctx.append(dashboard.lifecycle)
    return app


def door(identity: Identity, registry: Registry, metrics: RouterMetrics) -> Door:
    """The front door: the tenants of ``--tenants`` (none: everyone is anonymous), their
    limits kept on the board (shared by every serving process); who sent a request is
    asked only when some credential is configured."""
    identify = identity.identify if identity.configured else None
    limiter = Limiter(registry.board)
    return Door(identity.tenants, limiter, metrics, identity.config.classes, identify)


def reads_prefixes(config: RouterConfig, policy: Policy) -> bool:
    """Prompts are looked up in the engines' KV events: the policy reads what targets hold,
    or under ``--pd`` the policy of either side does (each side has its own)."""
    if config.pd is None:
        return needs_tokens(policy)
    options = config.policy_options()
    return any(needs_tokens(make_policy(config.role_policy(s), options)) for s in SIDES)


def prefix_parts(
    config: RouterConfig, registry: Registry, access: EngineAccess
) -> tuple[Lookup, Feed]:
    """The index, the engines' events that build it and the tokenizers that look prompts
    up in it; the tokenizer files are read now, at start-up."""
    index = KvIndex(config.kv_capacity)
    pool = ThreadPoolExecutor(2, thread_name_prefix="tokenise")
    try:
        tokens = prompt.load(config.tokenizer_dirs(), pool, prompt.TOKENS_KEPT)
    except (TokenizerError, OSError, ValueError) as exc:
        pool.shutdown()
        raise ConfigError(f"cannot load a tokenizer: {exc}") from None
    return Lookup(tokens, index, pool), Feed(registry, index, access=access)


def placer_for(parts: Parts, policy: Policy, role: Role) -> Places | None:
    """Where ``manual`` places a new routing key when its table is not this router's own:
    the control plane's under ``--processes``, a claim in etcd beside other replicas. The
    table's owner then moves keys off loaded targets, not this copy."""
    if not isinstance(policy, Manual):
        return None
    if parts.control is not None:
        placer: Places | None = parts.control.placer(policy, role)
    else:
        placer = claims(parts.sources, policy, role)
    if placer is not None:
        policy.bound = 0
    return placer


def relist_of(control: Control | None) -> Callable[[Worker], None] | None:
    """A serving process of several: the parent reads the engines' model lists."""
    return None if control is None else control.relist


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
    session = upstream_session(config, parts.access)
    if config.pd == "vllm-moriio" and parts.control is None:
        parts.registration = Registration(
            parts.registry, config.registration, config.heartbeat_timeout, parts.monitor.forget
        )
        await parts.registration.start()
    for source in parts.sources:
        await source.start()
    # typical output lengths, learned from the answers (``cap``: max_tokens as sent)
    output = OutputEstimate(learned=config.output_budget == "typical", board=parts.registry.board)
    proxy_parts = ProxyParts(
        config,
        parts.registry,
        parts.metrics,
        Upstream(session, config.connect_timeout, config.first_byte_timeout, parts.access),
        Retry(
            parts.breakers,
            parts.metrics,
            parts.monitor.suspect,
            limit=config.attempts,
            backoff=config.retry_backoff,
            seed=config.seed,
            relist=parts.lists.relist if parts.lists is not None else relist_of(parts.control),
        ),
        output,
        Aborter(session, parts.access),
        Dispatcher(
            DispatchOptions.of(config),
            output,
            parts.lock,
            partial(parts.metrics.holding, "slot"),
            parts.door.queued,
            parts.door.shed,
        ),
        parts.tracing,
        parts.monitor,
    )
    parts.rankless = Rankless(proxy_parts)
    if config.pd is not None:
        policies = {
            side: make_policy(config.role_policy(side), config.policy_options()) for side in SIDES
        }
        placers = {
            side: placer
            for side, policy in policies.items()
            if (placer := placer_for(parts, policy, side)) is not None
        }
        pair = PairProxy(proxy_parts, policies["prefill"], policies["decode"], placers, parts.lock)
        pair.lookup = parts.lookup  # each side's events: the feed follows every worker
        parts.proxy = pair
    else:
        if parts.control is not None and isinstance(parts.policy, CacheAware):
            parts.control.share_prefixes(parts.policy)
        placer = placer_for(parts, parts.policy, "regular")
        proxy = Proxy(proxy_parts, parts.policy, placer, parts.lock)
        proxy.lookup = parts.lookup
        parts.proxy = proxy
        parts.responses = Responses(proxy, parts.rankless, parts.response_ids)
    if parts.feed is not None:
        await parts.feed.start()
    await parts.monitor.start()
    if parts.lists is not None:
        await parts.lists.start()
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
        if parts.lists is not None:
            await parts.lists.stop()
        if parts.feed is not None:
            await parts.feed.stop()
        if parts.lookup is not None:
            parts.lookup.close()
        parts.breakers.stop()
        await session.close()
        await proxy_parts.tracing.stop()  # what is left is exported
