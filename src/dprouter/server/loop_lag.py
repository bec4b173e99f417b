"""Event-loop lag: how late a 100 ms timer fires, the worst of the last 10 s.

A loop busy with CPU work (or blocked by a stray synchronous call) serves every
client late; a burst's connect timeouts were this and nothing showed it. The
lateness of a timer the loop should have run is that delay, as a client sees it.
The worst over a few seconds rather than the last tick: a scrape every 15 s
would almost never land on the one late tick.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable


class LoopLag:
    def __init__(
        self,
        interval: float = 0.1,
        keep: float = 10.0,
        on_tick: Callable[[float], None] | None = None,
    ) -> None:
        self.interval = interval
        self.keep = keep
        self.on_tick = on_tick  # told the worst after every tick (the metric's gauge)
        self._late: deque[tuple[float, float]] = deque()  # (when measured, seconds late)
        self._task: asyncio.Task[None] | None = None

    @property
    def worst(self) -> float:
        """Seconds: the latest tick of the last ``keep`` seconds; 0 before the first."""
        return max((late for _, late in self._late), default=0.0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def note(self, now: float, late: float) -> None:
        self._late.append((now, max(late, 0.0)))
        while self._late and self._late[0][0] < now - self.keep:
            self._late.popleft()
        if self.on_tick is not None:
            self.on_tick(self.worst)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            now = loop.time()
            self.note(now, now - due)
