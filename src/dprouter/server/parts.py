"""The components of one router, made once from its configuration and passed to every
handler: no globals, so two routers can run side by side in one process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.core.tls import EngineAccess
from dprouter.core.tracing import Tracing
from dprouter.core.types import Role
from dprouter.engines.kvevents.feed import Feed
from dprouter.engines.kvevents.lookup import Lookup
from dprouter.fleet.board_lock import BoardLock
from dprouter.fleet.breakers import BreakerOptions, Breakers
from dprouter.fleet.membership import Source
from dprouter.fleet.membership.moriio import Registration
from dprouter.fleet.model_lists import ModelLists
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Worker
from dprouter.policies import Policy
from dprouter.policies.cache_aware import CacheAware
from dprouter.policies.manual import Manual
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.pd.pair import PairProxy
from dprouter.proxy.plain import Proxy
from dprouter.proxy.rankless import Rankless
from dprouter.proxy.response_ids import ResponseIds
from dprouter.proxy.responses import Responses
from dprouter.proxy.routing_keys import Places
from dprouter.server.admission import Admission
from dprouter.server.door import Door
from dprouter.server.drain import Drain
from dprouter.server.identity import Identity
from dprouter.server.loop_lag import LoopLag


class Control(Protocol):
    """What a serving process of ``--processes N`` shares with the others through the
    parent's control plane, which runs discovery, breakers, the admin API and the routing
    keys' table once for all of them (``multiproc/control_link.py`` implements it)."""

    processes: int  # serving processes in all

    def breakers(self, options: BreakerOptions) -> Breakers:
        """Breakers whose outcomes the parent decides on."""
        ...

    def admin_routes(self) -> list[web.RouteDef]:
        """The admin API, as the parent runs it."""
        ...

    def response_ids(self) -> ResponseIds:
        """Stored responses' ids, known to every serving process."""
        ...

    def placer(self, policy: Manual, role: Role) -> Places:
        """Where a new routing key goes: the parent's table decides, once."""
        ...

    def share_prefixes(self, policy: CacheAware) -> None:
        """``cache_aware`` learns what the other processes sent where."""
        ...

    def relist(self, worker: Worker) -> None:
        """The worker's engine does not serve a model asked of it: the parent reads its
        model list again."""
        ...

    async def held(self) -> tuple[int, float] | None:
        """For the dashboard: routing keys held, and when the router started (None: the
        parent did not say)."""
        ...


@dataclass
class Parts:
    config: RouterConfig
    registry: Registry
    policy: Policy
    monitor: Monitor
    metrics: RouterMetrics
    admission: Admission
    breakers: Breakers
    door: Door  # who sent each request, their limits and class
    identity: Identity  # whose credential a request carries; the admin check
    tracing: Tracing  # spans (--tracing) and request ids, from the front door on
    access: EngineAccess = field(default_factory=EngineAccess)  # engines' TLS and keys
    drain: Drain = field(default_factory=Drain)  # requests in flight, for a graceful stop
    response_ids: ResponseIds = field(default_factory=ResponseIds)  # which target made each
    # the request path's flows, made at start-up with the upstream session: generation...
    proxy: Proxy | PairProxy | None = None
    rankless: Rankless | None = None  # ...requests that name no rank...
    responses: Responses | None = None  # ...and the Responses API (not under --pd)
    registration: Registration | None = None  # MoRIIO instances register here
    sources: list[Source] = field(default_factory=list)  # of workers: etcd (not --processes)
    control: Control | None = None  # a serving process of --processes N: the parent's link
    lock: BoardLock | None = None  # ...and its decisions, one at a time with the others'
    lag: LoopLag = field(default_factory=LoopLag)  # the event loop's, for /metrics
    lookup: Lookup | None = None  # a policy that needs tokens: the prompt against the index
    lists: ModelLists | None = None  # the engines' model lists read again (not --processes)
    feed: Feed | None = None  # ...and the engines' KV events that build it


PARTS = web.AppKey("dprouter", Parts)
