"""Offline cluster simulator: the engine model driven in virtual time, no sockets.

Arrivals are routed by a callback that sees the live engine models (the same
load a router would read) and returns ``(engine index, rank or None)``; None
leaves the rank to the engine's internal balancer. Everything is
deterministic for a given workload and callback.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from dprouter.sim.config import EngineConfig
from dprouter.sim.engine import Engine, Stepper, StepPlan
from dprouter.sim.report import RankUse, SimReport, summarise
from dprouter.sim.request import SimRequest


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt_ids: Sequence[int]
    max_tokens: int = 16
    key: str | None = None  # routing key (session), for sticky policies
    bootstrap_room: int | None = None


@dataclass
class Cluster:
    """What the routing callback sees: the engines and the current virtual time."""

    engines: list[Engine]
    now: float = 0.0


Route = Callable[[Cluster, Arrival], tuple[int, int | None]]
OnFinish = Callable[[Arrival, SimRequest], None]
MAX_STEPS = 1 << 20  # decode-only runs are simulated as one event until the first finish


@dataclass
class _Usage:
    waiting_area: float = 0.0
    max_waiting: int = 0
    routed: int = 0


@dataclass
class OfflineSim:
    configs: Sequence[EngineConfig]
    route: Route
    on_finish: OnFinish | None = None  # e.g. to release a router's outstanding count
    max_steps: int = MAX_STEPS  # 1 simulates every decode step as its own event
    cluster: Cluster = field(init=False)

    def __post_init__(self) -> None:
        engines = [Engine(c, f"engine-{i}", track_tokens=False) for i, c in enumerate(self.configs)]
        self.cluster = Cluster(engines)
        self._usage = {(e, r.index): _Usage() for e, eng in enumerate(engines) for r in eng.ranks}
        self._owner = {id(s): e for e, eng in enumerate(engines) for s in eng.steppers}

    def run(self, arrivals: Iterable[Arrival]) -> SimReport:
        cpu0 = time.process_time()
        heap: list[tuple[float, int, StepPlan]] = []
        seq = itertools.count()
        done: list[SimRequest] = []
        origin: dict[str, Arrival] = {}
        engines = self.cluster.engines

        def kick(stepper: Stepper, now: float) -> None:
            plan = stepper.begin(now, self.max_steps)
            if plan is not None:
                heapq.heappush(heap, (plan.end, next(seq), plan))

        def step_until(limit: float) -> None:
            while heap and heap[0][0] <= limit:
                t, _, plan = heapq.heappop(heap)
                stepper = plan.stepper
                if plan is not stepper.running or t != plan.end:
                    continue  # superseded: the run was truncated and pushed again
                self.cluster.now = t
                e = self._owner[id(stepper)]
                for rank, part in plan.parts:
                    use = self._usage[(e, rank.index)]
                    use.waiting_area += part.waiting * plan.duration
                    use.max_waiting = max(use.max_waiting, part.waiting)
                events = engines[e].end(plan, t)
                for req in events.finished:
                    done.append(req)
                    if self.on_finish is not None:
                        self.on_finish(origin.pop(req.rid), req)
                kick(stepper, t)

        for n, arrival in enumerate(arrivals):
            step_until(arrival.time)
            self.cluster.now = arrival.time
            e, rank = self.route(self.cluster, arrival)
            rid = f"r{n}"
            req = SimRequest(
                rid,
                list(arrival.prompt_ids),
                arrival.max_tokens,
                arrival.time,
                rank,
                arrival.bootstrap_room,
            )
            origin[rid] = arrival
            stepper = engines[e].add(req, arrival.time)
            self._usage[(e, req.rank if req.rank is not None else 0)].routed += 1
            if stepper.running is None:
                kick(stepper, arrival.time)
            elif stepper.truncate(arrival.time):
                plan = stepper.running
                heapq.heappush(heap, (plan.end, next(seq), plan))
        step_until(float("inf"))
        return self._report(done, time.process_time() - cpu0)

    def _report(self, done: list[SimRequest], cpu: float) -> SimReport:
        makespan = max((r.finished_at or 0.0 for r in done), default=0.0)
        ranks = []
        for e, eng in enumerate(self.cluster.engines):
            for rank in eng.ranks:
                use = self._usage[(e, rank.index)]
                s = rank.stats
                ranks.append(
                    RankUse(
                        engine=e,
                        rank=rank.index,
                        requests=use.routed,
                        busy=s.busy_time / makespan if makespan else 0.0,
                        mean_waiting=use.waiting_area / makespan if makespan else 0.0,
                        max_waiting=use.max_waiting,
                        prefix_hit_rate=s.prefix_hits / s.prefix_queries
                        if s.prefix_queries
                        else 0.0,
                    )
                )
        return summarise(done, ranks, makespan, cpu)
