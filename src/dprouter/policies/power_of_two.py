"""``power_of_two``: the less loaded of two targets drawn at random."""

from __future__ import annotations

from collections.abc import Sequence

from dprouter.policies.base import PolicyOptions, RequestInfo, make_rng
from dprouter.targets import Target


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, options: PolicyOptions) -> None:
        self.rng = make_rng(options)

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        if len(targets) == 1:
            return targets[0]
        i, j = self.rng.sample(range(len(targets)), 2)
        a, b = targets[i], targets[j]
        return b if b.load < a.load else a
