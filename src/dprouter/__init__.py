"""dprouter: route LLM requests to (worker, dp_rank) targets; simulated engines built in."""

from dprouter.sim.cluster import SimCluster, fleet
from dprouter.sim.config import CostModel, EngineConfig, Faults, RankLimits
from dprouter.sim.offline import Arrival, Cluster, OfflineSim
from dprouter.sim.report import SimReport
from dprouter.sim.server import SimServer

__all__ = [
    "Arrival",
    "Cluster",
    "CostModel",
    "EngineConfig",
    "Faults",
    "OfflineSim",
    "RankLimits",
    "SimCluster",
    "SimReport",
    "SimServer",
    "fleet",
]
