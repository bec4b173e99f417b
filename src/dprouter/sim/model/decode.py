"""The decoding requests of one rank, advanced in O(finishers) per step.

Every decoding request gains one token per step, so a request's count is
``1 + tick - base_tick`` and its finish tick is known when it starts decoding;
a heap of finish ticks yields the finishers without touching the others. The
HTTP simulator, which streams every token, asks for the members each step.
"""

from __future__ import annotations

import heapq
import itertools

from dprouter.sim.model.request import SimRequest


class DecodeBatch:
    def __init__(self) -> None:
        self.tick = 0  # decode steps this rank has run
        self.members: dict[int, SimRequest] = {}  # by id(): client request ids may repeat
        self._heap: list[tuple[int, int, SimRequest]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.members)

    def add(self, req: SimRequest) -> None:
        """``req`` has just produced its first token."""
        req.generated = 1
        req.base_tick = self.tick
        self.members[id(req)] = req
        heapq.heappush(self._heap, (self.tick + req.max_tokens - 1, next(self._seq), req))

    def remove(self, req: SimRequest) -> None:
        req.generated = self.generated(req)
        del self.members[id(req)]  # its heap entry is skipped when it surfaces

    def generated(self, req: SimRequest) -> int:
        return 1 + self.tick - req.base_tick

    def steps_to_next_finish(self) -> int:
        heap = self._heap
        while heap and id(heap[0][2]) not in self.members:
            heapq.heappop(heap)
        return heap[0][0] - self.tick if heap else 0

    def advance(self, steps: int) -> list[SimRequest]:
        """Run ``steps`` steps; returns the requests that reached max_tokens."""
        self.tick += steps
        finished: list[SimRequest] = []
        heap = self._heap
        while heap and heap[0][0] <= self.tick:
            _, _, req = heapq.heappop(heap)
            if self.members.pop(id(req), None) is req:
                req.generated = req.max_tokens
                finished.append(req)
        return finished
