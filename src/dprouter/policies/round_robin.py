"""``round_robin``: one counter over the flat slot space of each pool.

One counter per pool (role, model, dialect): a shared counter would alias --
traffic alternating between two pools would land on the same index of each.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from dprouter.fleet.targets import Target
from dprouter.policies.base import PolicyOptions, RequestInfo


class RoundRobin:
    name = "round_robin"

    def __init__(self, options: PolicyOptions) -> None:
        self.counters: dict[Hashable, int] = {}

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        n = self.counters.get(request.pool, 0)
        self.counters[request.pool] = n + 1
        return targets[n % len(targets)]
