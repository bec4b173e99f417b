"""Admission control: at most ``limit`` requests in flight, a bounded queue behind them.

A request beyond the cap waits (first come, first served) for up to
``wait`` seconds while at most ``queue`` others wait too; otherwise it is
refused at once with a 429 and ``Retry-After`` -- an answer, never a reset.
A finishing request hands its slot straight to the longest waiter, so a
queued request cannot be overtaken by one that just arrived.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionOptions:
    """As ``RouterConfig`` says (``--max-concurrent``, ``--queue-size``, ``--queue-timeout``)."""

    limit: int  # requests in flight at once; 0: no cap
    queue: int  # requests waiting for a slot at most
    wait: float  # seconds a request waits for a slot before it is refused


class Admission:
    def __init__(self, options: AdmissionOptions) -> None:
        self.options = options
        self.active = 0  # requests holding a slot
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self) -> str | None:
        """Take a slot: None when admitted, else why not (the caller answers 429)."""
        limit = self.options.limit
        if limit <= 0 or (self.active < limit and not self._waiters):
            self.active += 1
            return None
        if len(self._waiters) >= self.options.queue:
            return f"{self.active} requests in flight and {self.waiting} queued (the cap)"
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            async with asyncio.timeout(self.options.wait):
                await slot
        except TimeoutError:
            if slot.done() and not slot.cancelled():
                return None  # handed over as the timer fired: keep it
            return f"no slot freed within {self.options.wait:g} s"
        except asyncio.CancelledError:  # the client left while queued
            if slot.done() and not slot.cancelled():
                self.leave()  # it was handed a slot it will never use
            raise
        finally:
            if slot in self._waiters:
                self._waiters.remove(slot)
        return None

    def leave(self) -> None:
        """Give back a slot: to the longest waiter if there is one."""
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # ``active`` is unchanged: the slot changes hands
                return
        self.active -= 1
