"""Circuit breakers, one per target: a rank that keeps failing stops getting traffic.

Live traffic is the signal. ``failures`` consecutive failed attempts on a
target (no answer in time, a 5xx, a broken answer) open its breaker: the
target leaves the routing snapshot while its sibling ranks keep serving.
After ``cooldown`` seconds it is half-open: back in the snapshot, and the
next outcome decides -- a success closes it, a failure opens it again. The
failed attempts themselves are retried elsewhere, so clients do not see them.

A breaker never opens the last closed target of its role: with every engine
failing, the engines' own answers reach the clients rather than the router
declaring a healthy-looking fleet dead (the failure mode of sglang #13894).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from dprouter.fleet.registry import Registry
from dprouter.fleet.targets import Target

log = logging.getLogger("dprouter.breaker")


@dataclass(frozen=True)
class BreakerOptions:
    failures: int = 5  # consecutive failures that open a target's breaker; 0: never
    cooldown: float = 10.0  # seconds open before the half-open trial


class Breakers:
    def __init__(self, registry: Registry, options: BreakerOptions | None = None) -> None:
        self.registry = registry
        self.options = options or BreakerOptions()
        self._failures: dict[Target, int] = {}  # consecutive, of targets with any
        self._trial: set[Target] = set()  # half-open: the next outcome decides
        self._timers: dict[Target, asyncio.TimerHandle] = {}

    def failures(self, target: Target) -> int:
        """Failures in a row of ``target`` since its last success."""
        return self._failures.get(target, 0)

    def succeeded(self, target: Target) -> None:
        if self._failures:  # the common case, nothing failed lately, costs one test
            self._failures.pop(target, None)
        if self._trial:
            self._trial.discard(target)

    def failed(self, target: Target) -> None:
        if self.options.failures <= 0 or target.tripped:
            return
        count = self._failures[target] = self._failures.get(target, 0) + 1
        if target in self._trial or count >= self.options.failures:
            self._open(target, count)

    def rest(self, target: Target, seconds: float) -> None:
        """Out for ``seconds``, as the engine's ``Retry-After`` asked; then simply back."""
        if not target.tripped:
            self._open(target, 0, seconds, trial=False)

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _open(
        self, target: Target, count: int, seconds: float | None = None, trial: bool = True
    ) -> None:
        closed = self.registry.snapshot.pool(target.worker.role)
        if all(t is target for t in closed):
            return  # the last one (or gone already): its engine's answers pass through
        seconds = self.options.cooldown if seconds is None else seconds
        target.tripped = True
        self._trial.discard(target)
        self.registry.rebuild()
        if count:
            log.warning(
                "target %s failed %d time(s) in a row: out for %g s", target.label, count, seconds
            )
        else:
            log.info(
                "target %s asked for a pause (Retry-After): out for %g s", target.label, seconds
            )
        loop = asyncio.get_running_loop()
        self._timers[target] = loop.call_later(seconds, self._close, target, trial)

    def _close(self, target: Target, trial: bool) -> None:
        self._timers.pop(target, None)
        target.tripped = False
        self._failures.pop(target, None)
        if trial:
            self._trial.add(target)
            log.info("target %s half-open: back in, its next answer decides", target.label)
        self.registry.rebuild()
