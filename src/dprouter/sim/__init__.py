"""Simulated vLLM and SGLang engines: served over HTTP, or offline in virtual time."""

from dprouter.sim.cluster import SimCluster, fleet
from dprouter.sim.config import CostModel, EngineConfig, Faults, RankLimits
from dprouter.sim.kvevents import KvEventsConfig
from dprouter.sim.offline import Arrival, Cluster, OfflineSim
from dprouter.sim.report import SimReport
from dprouter.sim.server import SimServer

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
