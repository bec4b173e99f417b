"""Simulated vLLM and SGLang engines: served over HTTP, or offline in virtual time."""

from dprouter.sim.http.cluster import SimCluster, fleet
from dprouter.sim.http.server import SimServer
from dprouter.sim.model.config import CostModel, EngineConfig, Faults, RankLimits
from dprouter.sim.model.kvevents import KvEventsConfig
from dprouter.sim.offline.offline import Arrival, Cluster, OfflineSim
from dprouter.sim.offline.report import SimReport

__all__ = [
    "Arrival",
    "Cluster",
    "CostModel",
    "EngineConfig",
    "Faults",
    "KvEventsConfig",
    "OfflineSim",
    "RankLimits",
    "SimCluster",
    "SimReport",
    "SimServer",
    "fleet",
]
