"""dprouter: route LLM requests to (worker, dp_rank) targets.

The package's face is the router's API. The simulated engines live in
``dprouter.sim`` and the benchmarks in ``dprouter.bench``; neither is loaded
by ``import dprouter``.

The names are loaded when first asked for (PEP 562): ``import dprouter`` alone, as
every ``dprouter.*`` import and the ``dprouter`` command begin with, costs nothing, so
the command has its signal handlers in place before the router's modules load (0.7 s
on an idle 2-core machine, seconds on a busy one: a SIGTERM meanwhile ended the
process with nothing logged).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dprouter.config import RouterConfig
    from dprouter.fleet.worker_spec import WorkerSpec
    from dprouter.server.app import build_app
    from dprouter.server.router import Router

__all__ = ["Router", "RouterConfig", "WorkerSpec", "build_app"]

# name -> the module that defines it
_HOMES = {
    "Router": "dprouter.server.router",
    "RouterConfig": "dprouter.config",
    "WorkerSpec": "dprouter.fleet.worker_spec",
    "build_app": "dprouter.server.app",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'dprouter' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # asked once: later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
