"""``random``: a uniform pick from a seeded generator."""

from __future__ import annotations

from collections.abc import Sequence

from dprouter.fleet.targets import Target
from dprouter.policies.base import PolicyOptions, RequestInfo, make_rng


class RandomPick:
    name = "random"

    def __init__(self, options: PolicyOptions) -> None:
        self.rng = make_rng(options)

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        return targets[self.rng.randrange(len(targets))]
