"""Graceful shutdown: requests in flight get the grace period -- that long, no longer.

The router tracks the handler of every proxied request. On stop it takes no new
ones (a request arriving on a kept-alive connection gets 503 with
``Connection: close``), waits until none is left or the grace has run out, then
cancels what remains with ``GRACE_OVER``: a stream that was cut ends with an
error event and ``[DONE]`` (see ``relay``), a request still waiting for its
answer gets 503; either way the upstream connection is closed, so the engine
stops, and an SGLang engine is also told to abort it.
"""

from __future__ import annotations

import asyncio
import logging

from dprouter.core.errors import GRACE_OVER

log = logging.getLogger("dprouter")


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.cut = 0  # requests cut when the grace ran out
        self._tasks: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> asyncio.Task[object] | None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            self._idle.clear()
        return task

    def leave(self, task: asyncio.Task[object] | None) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._idle.set()

    async def run(self, grace: float) -> int:
        """Wait up to ``grace`` seconds for requests in flight; cut the rest. How many?"""
        self.draining = True
        try:
            async with asyncio.timeout(grace):
                await self._idle.wait()
            return 0
        except TimeoutError:
            pass
        left = list(self._tasks)
        log.warning("grace period (%g s) over: cutting %d request(s) in flight", grace, len(left))
        for task in left:
            task.cancel(GRACE_OVER)
        await asyncio.wait(left, timeout=2.0)  # each writes its last words, then ends
        self.cut += len(left)
        return len(left)
