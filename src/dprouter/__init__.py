"""dprouter: route LLM requests to (worker, dp_rank) targets.

The package's face is the router's API. The simulated engines live in
``dprouter.sim`` and the benchmarks in ``dprouter.bench``; neither is loaded
by ``import dprouter``.
"""

from dprouter.config import RouterConfig
from dprouter.fleet.worker_spec import WorkerSpec
from dprouter.server.app import build_app
from dprouter.server.router import Router

__all__ = ["Router", "RouterConfig", "WorkerSpec", "build_app"]
