"""What every flow of the request path uses, made once per router at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from dprouter.config import RouterConfig
from dprouter.core.tracing import Tracing
from dprouter.fleet.monitor import Monitor
from dprouter.fleet.registry import Registry
from dprouter.proxy.abort import Aborter
from dprouter.proxy.dispatch import Dispatcher
from dprouter.proxy.metrics import RouterMetrics
from dprouter.proxy.output_budget import OutputEstimate
from dprouter.proxy.retry import Retry
from dprouter.proxy.upstream import Upstream


@dataclass(frozen=True, slots=True)
class ProxyParts:
    config: RouterConfig
    registry: Registry
    metrics: RouterMetrics
    upstream: Upstream  # sends an attempt
    retry: Retry  # what a failed attempt leads to
    output: OutputEstimate  # a request's likely output, learned from the answers
    aborter: Aborter  # SGLang: a client that leaves aborts its request on the engine
    dispatch: Dispatcher  # holds requests while every rank's running slots are taken
    tracing: Tracing  # each request's spans (off: no-ops) and its id
    monitor: Monitor  # the workers' weights versions: stated by answers, read on request
