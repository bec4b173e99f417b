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

from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.engine import Engine, Stepper, StepPlan
from dprouter.sim.model.rank import Rank
from dprouter.sim.model.request import SimRequest
from dprouter.sim.offline.report import RankUse, SimReport, summarise


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt_ids: Sequence[int]
    max_tokens: int = 16  # the output tokens the request will really run to
    key: str | None = None  # routing key (session), for sticky policies
    bootstrap_room: int | None = None
    limit: int | None = None  # the max_tokens the client sends; None: max_tokens itself


@dataclass
class Cluster:
    """What the routing callback sees: the engines and the current virtual time."""

    engines: list[Engine]
    now: float = 0.0


# (engine index, rank or None); None: the router holds the arrival and sends it later
# itself, with ``OfflineSim.send``
Route = Callable[[Cluster, Arrival], tuple[int, int | None] | None]
OnFinish = Callable[[Arrival, SimRequest], None]
OnStep = Callable[[int, Sequence[Rank], float], None]  # (engine index, its ranks, now)
INF = float("inf")
MAX_STEPS = 1 << 20  # decode-only runs are simulated as one event until the first finish


@dataclass
class _Usage:
    waiting_area: float = 0.0
    max_waiting: int = 0
    load_area: float = 0.0  # running + waiting, integrated over time
    max_load: int = 0
    routed: int = 0


@dataclass
class OfflineSim:
    configs: Sequence[EngineConfig]
    route: Route
    on_finish: OnFinish | None = None  # e.g. to release a router's outstanding count
    max_steps: int = MAX_STEPS  # 1 simulates every decode step as its own event
    # sees the ranks of every step that ends; with ``kv_events`` their caches keep a
    # journal of what they stored and evicted, for it to take (the engines' KV events)
    on_step: OnStep | None = None
    kv_events: bool = False
    cluster: Cluster = field(init=False)

    def __post_init__(self) -> None:
        engines = [
            Engine(c, f"engine-{i}", track_tokens=False, record_events=self.kv_events)
            for i, c in enumerate(self.configs)
        ]
        self.cluster = Cluster(engines)
        self._usage = {(e, r.index): _Usage() for e, eng in enumerate(engines) for r in eng.ranks}
        self._owner = {id(s): e for e, eng in enumerate(engines) for s in eng.steppers}
        self._later: list[tuple[float, int, Arrival]] = []  # arrivals injected while running
        self._seq = itertools.count()
        self._send: Callable[[Arrival, int, int | None], None] | None = None

    def send(self, arrival: Arrival, engine: int, rank: int | None) -> None:
        """Send an arrival the router held to ``engine`` (and ``rank``) now: from a
        callback, while ``run`` runs (its latency still counts from its arrival)."""
        if self._send is None:
            raise RuntimeError("OfflineSim.send works only while run() runs")
        self._send(arrival, engine, rank)

    def inject(self, arrival: Arrival) -> None:
        """Schedule one more arrival (no earlier than now): closed-loop clients call this
        from ``on_finish`` to send a session's next turn."""
        heapq.heappush(self._later, (max(arrival.time, self.cluster.now), next(self._seq), arrival))

    def run(self, arrivals: Iterable[Arrival]) -> SimReport:
        cpu0 = time.process_time()
        steps: list[tuple[float, int, StepPlan]] = []
        seq = self._seq
        done: list[SimRequest] = []
        origin: dict[str, Arrival] = {}
        engines = self.cluster.engines
        source = iter(arrivals)
        head = next(source, None)
        count = itertools.count()

        def kick(stepper: Stepper, now: float) -> None:
            plan = stepper.begin(now, self.max_steps)
            if plan is not None:
                heapq.heappush(steps, (plan.end, next(seq), plan))

        def end_step() -> None:
            t, _, plan = heapq.heappop(steps)
            stepper = plan.stepper
            if plan is not stepper.running or t != plan.end:
                return  # superseded: the run was truncated and pushed again
            self.cluster.now = t
            e = self._owner[id(stepper)]
            for rank, part in plan.parts:
                use = self._usage[(e, rank.index)]
                use.waiting_area += part.waiting * plan.duration
                use.max_waiting = max(use.max_waiting, part.waiting)
                use.load_area += (part.waiting + part.running) * plan.duration
                use.max_load = max(use.max_load, part.waiting + part.running)
            events = engines[e].end(plan, t)
            if self.on_step is not None:
                self.on_step(e, stepper.ranks, t)
            for req in events.finished:
                done.append(req)
                if self.on_finish is not None:
                    self.on_finish(origin.pop(req.rid), req)
            if stepper.running is None:  # a request sent from a callback may have begun it
                kick(stepper, t)

        def arrive(arrival: Arrival) -> None:
            self.cluster.now = max(arrival.time, self.cluster.now)
            chosen = self.route(self.cluster, arrival)
            if chosen is not None:
                send(arrival, *chosen)

        def send(arrival: Arrival, e: int, rank: int | None) -> None:
            now = self.cluster.now
            rid = f"r{next(count)}"
            req = SimRequest(
                rid,
                list(arrival.prompt_ids),
                arrival.max_tokens,
                arrival.time,
                rank,
                arrival.bootstrap_room,
            )
            origin[rid] = arrival
            stepper = engines[e].add(req, now)
            self._usage[(e, req.rank if req.rank is not None else 0)].routed += 1
            if stepper.running is None:
                kick(stepper, now)
            elif stepper.truncate(now):
                plan = stepper.running
                heapq.heappush(steps, (plan.end, next(seq), plan))

        self._send = send

        while True:
            later = self._later[0][0] if self._later else INF
            t_arrival = min(head.time if head is not None else INF, later)
            if steps and steps[0][0] <= t_arrival:
                end_step()  # may inject arrivals: look again before the next one
            elif t_arrival < INF:
                if head is not None and head.time <= later:
                    arrive(head)
                    head = next(source, None)
                else:
                    arrive(heapq.heappop(self._later)[2])
            else:
                break
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
                        mean_load=use.load_area / makespan if makespan else 0.0,
                        max_load=use.max_load,
                        prefix_hit_rate=s.prefix_hits / s.prefix_queries
                        if s.prefix_queries
                        else 0.0,
                    )
                )
        return summarise(done, ranks, makespan, cpu)
