"""``manual``: a routing key sticks to the target it was first given.

New keys are placed by the assignment mode -- ``random``, ``min_load`` (fewest
outstanding) or ``min_group`` (fewest keys already stuck to it). A key moves
only when its target leaves the snapshot (removed or unhealthy; a retry
elsewhere after one failed attempt leaves the key where it was); keys idle
longer than ``key_ttl`` are forgotten. Requests with no key go to the least
loaded target.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from dprouter.policies.base import PolicyOptions, RequestInfo, least_loaded, make_rng
from dprouter.targets import Target


class Manual:
    name = "manual"

    def __init__(self, options: PolicyOptions) -> None:
        self.rng = make_rng(options)
        self.assignment = options.assignment
        self.ttl = options.key_ttl
        self.sticky: OrderedDict[str, tuple[Target, float]] = OrderedDict()  # oldest use first
        self.group: Counter[str] = Counter()  # keys per target label
        self.start = 0

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self._expire(request.now)
        key = request.key
        if key is None:
            self.start += 1
            return least_loaded(targets, self.start)
        held = self.sticky.get(key)
        if held is not None and held[0] in targets:
            target = held[0]
        elif held is not None and request.attempt > 0:
            return self._assign(targets)  # one failed attempt does not move the key for good
        else:
            if held is not None:
                self.group[held[0].label] -= 1
            target = self._assign(targets)
            self.group[target.label] += 1
        self.sticky[key] = (target, request.now)
        self.sticky.move_to_end(key)
        return target

    def _assign(self, targets: Sequence[Target]) -> Target:
        if self.assignment == "random":
            return targets[self.rng.randrange(len(targets))]
        self.start += 1
        if self.assignment == "min_load":
            return least_loaded(targets, self.start)
        n = len(targets)
        order = [targets[(self.start + i) % n] for i in range(n)]
        return min(order, key=lambda t: self.group[t.label])

    def _expire(self, now: float) -> None:
        sticky = self.sticky
        while sticky:
            key, (target, seen) = next(iter(sticky.items()))
            if now - seen <= self.ttl:
                break
            del sticky[key]
            self.group[target.label] -= 1
