"""``power_of_two``: the less loaded of two targets drawn at random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from dprouter.fleet.targets import Target
from dprouter.policies.base import PolicyOptions, RequestInfo, make_rng

SAMPLE_POOL = 21  # random.sample's own threshold between its two methods, for k = 2


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, options: PolicyOptions) -> None:
        self.rng = make_rng(options)

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        n = len(targets)
        if n == 1:
            return targets[0]
        i, j = two_of(self.rng, n)
        a, b = targets[i], targets[j]
        return b if b.load < a.load else a


def two_of(rng: random.Random, n: int) -> tuple[int, int]:
    """``rng.sample(range(n), 2)`` step for step (the same draws, the same answer), without
    its generality's cost: up to 21 it swaps the first pick out, beyond it redraws."""
    i = rng.randrange(n)
    if n <= SAMPLE_POOL:
        j = rng.randrange(n - 1)
        return i, (n - 1 if j == i else j)
    j = rng.randrange(n)
    while j == i:
        j = rng.randrange(n)
    return i, j
