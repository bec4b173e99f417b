"""dprouter: route LLM requests to (worker, dp_rank) targets.

The package's face is the router's API. The simulated engines live in
``dprouter.sim`` and the benchmarks in ``dprouter.bench``; neither is loaded
by ``import dprouter``.
"""

from dprouter.app import Router, build_app
from dprouter.config import RouterConfig, WorkerSpec

__all__ = ["Router", "RouterConfig", "WorkerSpec", "build_app"]
