"""``least_load``: the target with the fewest outstanding requests."""

from __future__ import annotations

from collections.abc import Sequence

from dprouter.fleet.targets import Target
from dprouter.policies.base import PolicyOptions, RequestInfo, least_loaded, readers


class LeastLoad:
    name = "least_load"

    def __init__(self, options: PolicyOptions) -> None:
        self.start = 0  # rotating tie-break: equal loads are served in turn
        self.readers = readers()

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        return least_loaded(targets, self.start, self.readers.of(targets))
