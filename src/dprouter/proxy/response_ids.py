"""Response ids -> the label of the target that made each: bounded and expiring.

Kept apart from ``responses`` so that the control plane holds one without the request path.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class ResponseIds:
    """Response id -> the label of the target that made it, bounded and expiring."""

    def __init__(
        self,
        size: int = 100_000,
        ttl: float = 86_400.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.size = size
        self.ttl = ttl
        self.clock = clock
        self.ids: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def put(self, rid: str, label: str) -> None:
        self.ids[rid] = (label, self.clock() + self.ttl)
        self.ids.move_to_end(rid)
        while len(self.ids) > self.size:
            self.ids.popitem(last=False)

    def get(self, rid: str) -> str | None:
        found = self.ids.get(rid)
        if found is None:
            return None
        label, expires = found
        if self.clock() >= expires:
            del self.ids[rid]
            return None
        self.put(rid, label)  # in use: kept longer
        return label

    async def note(self, rid: str, label: str) -> None:
        self.put(rid, label)

    async def find(self, rid: str) -> str | None:
        return self.get(rid)
