"""Which targets may serve a request: the one pool rule, for plain, P/D and rankless
requests alike.

A request's pool, per role, is the snapshot's targets of that role serving its model
(and the path's dialect, where only one engine kind serves the path). A rank a trusted
client pinned keeps the targets of that rank and those with none: a target with no
rank is a worker with one rank, or one whose engine places requests itself
(``--dp-aware off``), and either serves the pinned rank as its engine does. When a
role has no target left, the client hears why:

- 400: no target has the pinned rank;
- 404: the model is served by no worker, though others are ready (``unknown_model``);
- 404: no worker of the path's dialect is even configured (none ever will be);
- 503: no ready worker (yet) for the role or the path (``no_target``).

A request may wait for a pool (``wait_pools``): while the workers that could serve it
are held (paused, updating their weights) or older than the weights it asks for. One
waiting for weights has the engines' versions read at once, and again every ``POLL``
seconds while it waits: an engine updated straight, not through the router, serves them
already, and the request does not wait for the periodic read to learn it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence

from aiohttp import web

from dprouter.core.errors import ConfigError, error
from dprouter.core.headers import WEIGHT_VERSION_HEADER
from dprouter.core.types import DialectName, Role
from dprouter.fleet import adapters
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target
from dprouter.fleet.weights import Wanted, newest
from dprouter.proxy.limiter import ENTRY
from dprouter.proxy.metrics import RouterMetrics

DIALECT_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
POLL = 0.5  # seconds between reads of the versions while a request waits for weights
Pools = tuple[Sequence[Target], ...]


def choose_pools(
    registry: Registry,
    metrics: RouterMetrics,
    roles: Sequence[Role],
    model: str | None,
    path: str,
    dialect: DialectName | None = None,
    pinned: Mapping[Role, int | None] | None = None,
    count: bool = True,
) -> Pools | web.Response:
    """One pool per role, in the order of ``roles``, or the error to answer with (counted
    in the metrics unless ``count`` is False: a request that may wait is counted once)."""
    snapshot = registry.snapshot
    if not pinned and len(roles) == 1:  # the common case: one pool, no rank pinned
        found = snapshot.pool(roles[0], model, dialect)
        if found:
            return (found,)
    pools: list[Sequence[Target]] = []
    for role in roles:
        pool: Sequence[Target] = snapshot.pool(role, model, dialect)
        rank = pinned.get(role) if pinned else None
        if pool and rank is not None:
            pool = tuple(t for t in pool if t.rank is None or t.rank == rank)
            if not pool:
                name = "" if role == "regular" else f"{role} "
                return error(400, f"no {name}target has dp_rank {rank}")
        pools.append(pool)
    if all(pools):
        return tuple(pools)
    if model is not None and all(snapshot.pool(role, None, dialect) for role in roles):
        if count:
            metrics.rejected.labels("unknown_model").inc()
        return error(404, adapters.missing(model), "model")
    missing = next(role for role, pool in zip(roles, pools, strict=True) if not pool)
    return no_pool(registry, metrics, dialect, path, missing, count)


def no_pool(
    registry: Registry,
    metrics: RouterMetrics,
    dialect: DialectName | None,
    path: str,
    role: Role = "regular",
    count: bool = True,
) -> web.Response:
    """The answer when no target can take a request: 404 when no worker of the path's
    dialect is even configured (none ever will be), else 503."""
    if count:
        metrics.rejected.labels("no_target").inc()
    if dialect is None:
        what = "worker" if role == "regular" else f"{role} worker"
        return error(503, f"no ready {what} to route to")
    name = DIALECT_NAMES[dialect]
    if all(w.dialect not in (dialect, None) for w in registry.workers.values()):
        return error(404, f"no {name} worker is configured: {path} is {name}'s own endpoint")
    return error(503, f"no ready {name} worker for {path} to route to")


async def wait_pools(
    request: web.Request,
    registry: Registry,
    metrics: RouterMetrics,
    roles: Sequence[Role],
    model: str | None,
    wait: float,
    dialect: DialectName | None = None,
    pinned: Mapping[Role, int | None] | None = None,
    read_versions: Callable[[], Awaitable[None]] | None = None,
) -> Pools | web.Response:
    """``choose_pools`` for a request that may wait up to ``wait`` seconds while every
    worker that could serve it is held, or older than the weights it asks for in
    ``X-DPRouter-Weight-Version``: a weight update pauses engines for seconds, and a
    rollout would rather wait than fail."""
    header = request.headers.get(WEIGHT_VERSION_HEADER)
    if header is None and not registry.held:  # the hot path: nothing to wait for
        return choose_pools(registry, metrics, roles, model, request.path, dialect, pinned)
    wanted = None
    if header is not None:
        try:
            wanted = Wanted.parse(header)
        except ConfigError as exc:
            return error(400, str(exc), WEIGHT_VERSION_HEADER)

    def once(count: bool = False) -> Pools | web.Response:
        chosen = choose_pools(registry, metrics, roles, model, request.path, dialect, pinned, count)
        if wanted is None or isinstance(chosen, web.Response):
            return chosen
        latest = newest(w.weight_version for w in registry.ready())
        kept = tuple(
            tuple(t for t in pool if wanted.serves(t.worker.weight_version, latest))
            for pool in chosen
        )
        if all(kept):
            return kept
        return error(503, f"no ready worker serves weights {wanted.floor or latest} yet")

    def waits(chosen: Pools | web.Response) -> bool:
        """No pool now, but a held worker could serve it, or a newer version may come: a
        model or a rank only a held worker has is not unknown, it is paused."""
        if not isinstance(chosen, web.Response) or wait <= 0:
            return False
        if chosen.status == 503:
            return registry.held or wanted is not None
        return registry.held and any(
            w.held is not None
            and w.role in roles
            and (model is None or w.serves(model))
            and (dialect is None or w.dialect == dialect)
            for w in registry.ready()
        )

    chosen = once()
    if not waits(chosen):
        return chosen if not isinstance(chosen, web.Response) else once(count=True)
    changed = asyncio.Event()
    registry.listeners.append(changed.set)
    entry = request.get(ENTRY)
    priority = 0 if entry is None else entry.caller.priority
    metrics.holding("worker", priority, 1)  # held in the router: the live view counts it
    try:
        async with asyncio.timeout(wait):
            while waits(chosen):
                changed.clear()
                if wanted is None or read_versions is None:
                    await changed.wait()
                else:
                    await read_versions()  # joins a read under way, if there is one
                    if waits(chosen := once()):
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(changed.wait(), POLL)
                chosen = once()
    except TimeoutError:
        held = sorted({w.held for w in registry.ready() if w.held is not None})
        if held:
            metrics.rejected.labels("no_target").inc()
            why = " or ".join(held)
            return error(503, f"every worker that could serve it is {why}; waited {wait:g} s")
    finally:
        registry.listeners.remove(changed.set)
        metrics.holding("worker", priority, -1)
    return chosen if not isinstance(chosen, web.Response) else once(count=True)
