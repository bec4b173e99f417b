"""The router's own policies driving the offline simulator.

Targets are built from the simulated engines exactly as the router builds them
from live workers (one per rank when DP-aware, one per engine when not), and a
request's outstanding count is held from routing until the engine finishes it
-- the same load signal the router keeps -- so routing quality measured here is
the policies' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dprouter.policies import Policy, PolicyOptions, RequestInfo, make_policy
from dprouter.registry import Registry
from dprouter.sim.config import EngineConfig
from dprouter.sim.offline import Arrival, Cluster, OfflineSim
from dprouter.sim.report import SimReport
from dprouter.sim.request import SimRequest
from dprouter.targets import Outstanding, Target, Worker


class SimRouter:
    """Routes offline arrivals with a policy over (engine, rank) targets."""

    def __init__(
        self,
        configs: Sequence[EngineConfig],
        policy: str | Policy,
        dp_aware: bool = True,
        options: PolicyOptions | None = None,
    ) -> None:
        self.registry = Registry(dp_aware=dp_aware)
        for i, c in enumerate(configs):
            worker = Worker(id=f"e{i}", url=f"http://sim-{i}:1", dialect="vllm")
            worker.ranks = c.dp_size
            self.registry.add(worker)
            self.registry.mark_ready(worker)
        self.pool = self.registry.snapshot.pool()
        self.index = {w.id: i for i, w in enumerate(self.registry.workers.values())}
        self.policy = make_policy(policy, options) if isinstance(policy, str) else policy
        self.held: dict[int, Outstanding] = {}
        self.decisions = 0

    def route(self, cluster: Cluster, arrival: Arrival) -> tuple[int, int | None]:
        text = " ".join(map(str, arrival.prompt_ids[:512]))  # affinity sees the prompt's start
        tokens = len(arrival.prompt_ids) + arrival.max_tokens
        target: Target = self.policy.select(
            self.pool, RequestInfo(key=arrival.key, text=text, tokens=tokens, now=cluster.now)
        )
        guard = Outstanding(target, tokens)
        guard.__enter__()
        self.held[id(arrival)] = guard
        self.decisions += 1
        return self.index[target.worker.id], target.rank

    def finished(self, arrival: Arrival, req: SimRequest) -> None:
        self.held.pop(id(arrival)).__exit__(None, None, None)


class Sessions(Protocol):
    """A closed-loop workload: a session sends its next turn when the last one is done."""

    def first_turns(self) -> list[Arrival]: ...

    def next_turn(self, done: Arrival, req: SimRequest, now: float) -> Arrival | None: ...


def run_sessions(
    configs: Sequence[EngineConfig], router: SimRouter, sessions: Sessions
) -> tuple[SimReport, OfflineSim]:
    sim = OfflineSim(list(configs), router.route)

    def finished(arrival: Arrival, req: SimRequest) -> None:
        router.finished(arrival, req)
        following = sessions.next_turn(arrival, req, sim.cluster.now)
        if following is not None:
            sim.inject(following)

    sim.on_finish = finished
    return sim.run(sessions.first_turns()), sim
