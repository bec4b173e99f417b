"""The engine model in virtual time: ranks, how they step, how requests land.

Pure: no I/O and no clock of its own. A driver (the real-time runner behind
the HTTP server, or the offline cluster simulator) calls ``begin`` on a stepper,
waits ``plan.duration`` virtual seconds, then calls ``end``.

With DP attention all ranks of the engine form one stepper: every forward step
takes as long as the slowest rank's attention and idle ranks wait for it, so one
overloaded rank slows every request of the engine; the MLP (or MoE) layers run on
every rank's tokens gathered, split over all the engine's GPUs, so a prompt
computed on several ranks at once costs the engine that many times over. Without
it each rank is a stepper of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dprouter.sim.model.config import EngineConfig
from dprouter.sim.model.dispatch import make_dispatcher
from dprouter.sim.model.rank import Rank, RankPlan, StepEvents
from dprouter.sim.model.request import SimRequest


@dataclass
class StepPlan:
    stepper: Stepper
    start: float
    step_time: float  # the slowest rank's cost: every rank of the stepper waits for it
    steps: int
    parts: list[tuple[Rank, RankPlan]]

    @property
    def duration(self) -> float:
        return self.step_time * self.steps

    @property
    def end(self) -> float:
        return self.start + self.duration


class Stepper:
    def __init__(self, index: int, ranks: list[Rank]) -> None:
        self.index = index
        self.ranks = ranks
        self.running: StepPlan | None = None
        self.busy_time = 0.0
        self.steps = 0

    def has_work(self) -> bool:
        return any(r.has_work() for r in self.ranks)

    def begin(self, now: float, max_steps: int = 1) -> StepPlan | None:
        """Plan the next step (or, offline, a run of identical decode steps)."""
        if self.running is not None:
            raise RuntimeError("a step is already running")
        parts = [(r, p) for r in self.ranks if (p := r.plan(now, max_steps)) is not None]
        if not parts:
            return None
        steps = min(p.steps for _, p in parts)
        for _, p in parts:
            p.steps = steps
        step_time = self._step_time(parts, steps)
        self.running = StepPlan(self, now, step_time, steps, parts)
        return self.running

    def truncate(self, now: float) -> bool:
        """Cut a multi-step run short after the step in progress at ``now``, so
        that a request arriving now joins the batch at the next step boundary."""
        plan = self.running
        if plan is None or plan.steps == 1 or plan.step_time <= 0:
            return False
        steps = min(plan.steps, int((now - plan.start) / plan.step_time) + 1)
        if steps == plan.steps:
            return False
        plan.steps = steps
        for _, p in plan.parts:
            p.steps = steps
        plan.step_time = self._step_time(plan.parts, steps)
        return True

    def _step_time(self, parts: list[tuple[Rank, RankPlan]], steps: int) -> float:
        """The slowest rank's own work, plus every rank's gathered work shared out."""
        own = max(r.step_cost(p, steps) - p.gathered for r, p in parts)
        return own + sum(p.gathered for _, p in parts) / len(self.ranks)

    def end(self, plan: StepPlan, now: float) -> StepEvents:
        if plan is not self.running:
            raise RuntimeError("ending a step that is not running")
        self.running = None
        self.busy_time += plan.duration
        self.steps += plan.steps
        events = StepEvents()
        for rank, part in plan.parts:
            rank.commit(part, now, events)
        return events


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        engine_id: str = "engine-0",
        track_tokens: bool = True,
        record_events: bool = False,  # the ranks' caches keep a journal someone takes
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        slow = config.faults.slow_ranks
        self.ranks = [
            Rank(
                i,
                config.limits,
                config.cost,
                slow.get(i, 1.0),
                track_tokens,
                record_events,
                mixed=config.mixes_chunks,
                cache_on_schedule=config.persona == "vllm",
            )
            for i in range(config.dp_size)
        ]
        if config.dp_attention:
            self.steppers = [Stepper(0, list(self.ranks))]
        else:
            self.steppers = [Stepper(i, [r]) for i, r in enumerate(self.ranks)]
        self._stepper_of = [
            self.steppers[0 if config.dp_attention else i] for i in range(config.dp_size)
        ]
        self.dispatcher = make_dispatcher(config)

    @property
    def dp_size(self) -> int:
        return self.config.dp_size

    def stepper_of(self, rank: int) -> Stepper:
        return self._stepper_of[rank]

    def add(self, req: SimRequest, now: float) -> Stepper:
        """Queue a request on its pinned rank, or where the internal balancer says.

        Raises ``DispatchError`` when the balancer cannot place it; the caller
        checks a pinned rank's range first (each persona words that error itself).
        """
        rank = req.rank
        if rank is None:
            rank = self.dispatcher.pick(self.ranks, req, now)
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} out of range [0, {self.dp_size})")
        self.ranks[rank].enqueue(req)
        return self._stepper_of[rank]

    def end(self, plan: StepPlan, now: float) -> StepEvents:
        return plan.stepper.end(plan, now)

    def reset_prefix_cache(self) -> None:
        """vLLM's ``/reset_prefix_cache``, SGLang's ``/flush_cache``: every rank forgets."""
        for rank in self.ranks:
            rank.cache.clear()

    def abort(self, req: SimRequest, now: float) -> None:
        if req.rank is not None and not req.done:
            self.ranks[req.rank].abort(req, now)
