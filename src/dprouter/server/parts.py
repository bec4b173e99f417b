"""The components of one router, made once from its configuration and passed to every
handler: no globals, so two routers can run side by side in one process."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from dprouter.config import RouterConfig
from dprouter.engines.kvevents.feed import Feed
from dprouter.engines.kvevents.lookup import Lookup
from dprouter.fleet.board_lock import Turn
from dprouter.fleet.breakers import Breakers
from dprouter.fleet.membership import Source
from dprouter.fleet.membership.moriio import Registration
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry
from dprouter.multiproc.follower import Channel
from dprouter.policies import Policy
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.pd.pair import PairProxy
from dprouter.proxy.plain import Proxy
from dprouter.server.admission import Admission
from dprouter.server.drain import Drain
from dprouter.server.loop_lag import LoopLag


@dataclass
class Parts:
    config: RouterConfig
    registry: Registry
    policy: Policy
    monitor: Monitor
    metrics: RouterMetrics
    admission: Admission
    breakers: Breakers
    drain: Drain = field(default_factory=Drain)  # requests in flight, for a graceful stop
    proxy: Proxy | PairProxy | None = None  # made at start-up, with the upstream session
    registration: Registration | None = None  # MoRIIO instances register here
    sources: list[Source] = field(default_factory=list)  # of workers: etcd (not --processes)
    control: Channel | None = None  # a serving process of --processes N: the parent's link
    turn: Turn | None = None  # ...and its decisions, one at a time with the others'
    lag: LoopLag = field(default_factory=LoopLag)  # the event loop's, for /metrics
    lookup: Lookup | None = None  # a policy that needs tokens: the prompt against the index
    feed: Feed | None = None  # ...and the engines' KV events that build it


PARTS = web.AppKey("dprouter", Parts)
