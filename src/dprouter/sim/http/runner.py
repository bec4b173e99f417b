"""Drives an engine model in wall-clock time for the HTTP simulator.

One task per stepper: plan a step, sleep its duration (times ``time_scale``),
commit it, hand each request its new tokens. Virtual time advances by the
planned durations, so the model's timings stay exact even when the event loop
runs late; a late loop only shows up as idle time between steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dprouter.sim.model.engine import Engine, Stepper
from dprouter.sim.model.rank import Rank
from dprouter.sim.model.request import SimRequest

# what a request's queue carries: tokens generated so far, and whether it is done
Progress = tuple[int, bool]


ABORTED = -2  # progress of a request ended by /abort_request (-1: the engine stopped)


class EngineRunner:
    """``on_step`` sees the ranks of every step that ends (the KV events go out there)."""

    def __init__(self, engine: Engine, on_step: Callable[[list[Rank]], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.scale = engine.config.time_scale
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._wake = {s: asyncio.Event() for s in engine.steppers}
        self._queues: dict[str, asyncio.Queue[Progress]] = {}
        self._live: dict[str, SimRequest] = {}  # by rid, for SGLang's /abort_request
        self._tasks: list[asyncio.Task[None]] = []
        self._virtual_floor = 0.0  # virtual time never runs backwards past a committed step
        self._held = False  # paused: no step begins (the step running ends)

    def now(self) -> float:
        return max((self._loop.time() - self._t0) / self.scale, self._virtual_floor)

    def start(self) -> None:
        for s in self.engine.steppers:
            self._tasks.append(asyncio.create_task(self._drive(s), name=f"step-{s.index}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for q in self._queues.values():
            q.put_nowait((-1, True))  # wakes any handler still waiting
        self._queues.clear()

    def submit(self, req: SimRequest) -> asyncio.Queue[Progress]:
        """Queue a request; raises ``DispatchError`` when the engine cannot place it."""
        stepper = self.engine.add(req, self.now())
        queue: asyncio.Queue[Progress] = asyncio.Queue()
        self._queues[req.rid] = queue
        self._live[req.rid] = req
        self._wake[stepper].set()
        return queue

    def abort(self, req: SimRequest) -> None:
        self._queues.pop(req.rid, None)
        self._live.pop(req.rid, None)
        self.engine.abort(req, self.now())
        if req.rank is not None:
            self._wake[self.engine.stepper_of(req.rank)].set()  # freed KV may admit others

    def abort_rid(self, rid: str) -> bool:
        """Abort a request by id (SGLang's ``/abort_request``); its handler ends it."""
        req = self._live.get(rid)
        if req is None:
            return False
        queue = self._queues.get(rid)
        self.abort(req)
        if queue is not None:
            queue.put_nowait((ABORTED, True))
        return True

    def live(self) -> int:
        """Requests in the engine: running or waiting."""
        return len(self._live)

    def abort_all(self) -> int:
        """Abort every request in the engine; their handlers end them. How many."""
        return self.abort_prefix("")

    def abort_prefix(self, prefix: str) -> int:
        """Abort every request whose id starts with ``prefix``. How many."""
        return sum(self.abort_rid(rid) for rid in list(self._live) if rid.startswith(prefix))

    def hold(self, held: bool) -> None:
        """Paused (True): no step begins until released; requests stay where they are."""
        self._held = held
        if not held:
            for wake in self._wake.values():
                wake.set()

    async def _drive(self, stepper: Stepper) -> None:
        wake = self._wake[stepper]
        while True:
            if self._held or not stepper.has_work():
                wake.clear()
                await wake.wait()
                continue
            start = self.now()
            plan = stepper.begin(start)
            if plan is None:  # nothing admissible yet: wait for the next arrival or abort
                wake.clear()
                await wake.wait()
                continue
            end = start + plan.duration
            delay = end * self.scale - (self._loop.time() - self._t0)
            await asyncio.sleep(max(delay, 0.0))
            self._virtual_floor = max(self._virtual_floor, end)
            events = self.engine.end(plan, end)
            if self.on_step is not None:
                self.on_step(stepper.ranks)
            for req in events.tokens:
                queue = self._queues.get(req.rid)
                if queue is not None:
                    queue.put_nowait((req.generated, req.done))
            for req in events.finished:
                self._live.pop(req.rid, None)
                self._queues.pop(req.rid, None)
