"""``round_robin``: one counter over the flat slot space of the snapshot."""

from __future__ import annotations

from collections.abc import Sequence

from dprouter.policies.base import PolicyOptions, RequestInfo
from dprouter.targets import Target


class RoundRobin:
    name = "round_robin"

    def __init__(self, options: PolicyOptions) -> None:
        self.n = 0

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        target = targets[self.n % len(targets)]
        self.n += 1
        return target
