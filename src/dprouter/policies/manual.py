"""``manual``: a routing key sticks to the target it was first given.

New keys are placed by the assignment mode -- ``random``, ``min_load`` (fewest
outstanding) or ``min_group`` (fewest keys already stuck to it). A key moves
when its target leaves the snapshot (removed or unhealthy; a retry elsewhere
after one failed attempt leaves the key where it was), and when its target is
overloaded: a key **yields** -- moves for good to the least loaded target --
when its target's load is at least ``session_bound`` x the mean load of the
candidates + 2 (load: the board's, in flight and engine-reported). The + 2
keeps light load from ever moving a session (its prefix cache is worth more
than one request of imbalance); the bound caps what one rank can be handed
beyond its share (bounded-load consistent hashing's rule, with slack). 0
turns yielding off. Keys idle longer than ``key_ttl`` are forgotten. Requests
with no key go to the least loaded target. A key sticks per model, its adapter included
(``affinity_key``): a session sent to two adapters, whose prompts an engine caches
apart, is two keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from dprouter.fleet.targets import Target
from dprouter.policies.base import (
    PolicyOptions,
    Reader,
    RequestInfo,
    affinity_key,
    least_loaded,
    make_rng,
    readers,
)


class Manual:
    name = "manual"

    def __init__(self, options: PolicyOptions) -> None:
        self.rng = make_rng(options)
        self.assignment = options.assignment
        self.ttl = options.key_ttl
        # 0: never yield (a process that follows another table: the table's owner yields)
        self.bound = options.session_bound
        self.sticky: OrderedDict[str, tuple[Target, float]] = OrderedDict()  # oldest use first
        self.start = 0
        self.readers = readers()
        # keys stuck to each target, by board slot; a slot counts for the target that holds
        # it now (a removed worker's slots are handed on)
        self.keys_on = np.zeros(0, np.int64)
        self._owner: dict[int, Target] = {}
        self._counted: Reader | None = None  # the pool whose slots were last claimed

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self._expire(request.now)
        key = affinity_key(request)
        if key is None:
            self.start += 1
            return least_loaded(targets, self.start, self.readers.of(targets))
        held = self.sticky.get(key)
        if held is not None and held[0] in targets:
            target = held[0]
            if self.bound and len(targets) > 1 and self._overloaded(targets, target):
                self.count(target, -1)
                self.start += 1
                target = least_loaded(targets, self.start, self.readers.of(targets))
                self.count(target, 1)
                target.board.moved()
        elif held is not None and request.attempt > 0:
            return self._assign(targets)  # one failed attempt does not move the key for good
        else:
            if held is not None:
                self.count(held[0], -1)
            target = self._assign(targets)
            self.count(target, 1)
        self.sticky[key] = (target, request.now)
        self.sticky.move_to_end(key)
        return target

    def count(self, target: Target, change: int) -> None:
        """One key more (or fewer) stuck to ``target``."""
        if self._owner.get(target.slot) is not target:
            if change < 0:
                return  # the target is gone and its slot handed on: nothing to take back
            self._own(target)
        self.keys_on[target.slot] += change

    def _own(self, target: Target) -> None:
        if len(self.keys_on) < target.board.slots:
            grown = np.zeros(target.board.slots, np.int64)
            grown[: len(self.keys_on)] = self.keys_on
            self.keys_on = grown
        self._owner[target.slot] = target
        self.keys_on[target.slot] = 0

    def _assign(self, targets: Sequence[Target]) -> Target:
        if self.assignment == "random":
            return targets[self.rng.randrange(len(targets))]
        self.start += 1
        reader = self.readers.of(targets)
        if self.assignment == "min_load":
            return least_loaded(targets, self.start, reader)
        if len(targets) == 1:
            return targets[0]
        if reader is not self._counted:  # a pool not seen before: its slots count for it
            self._counted = reader
            for t in targets:
                if self._owner.get(t.slot) is not t:
                    self._own(t)
        return targets[reader.least(self.keys_on, self.start)]

    def _overloaded(self, targets: Sequence[Target], target: Target) -> bool:
        load = target.board.load_of(target.slot)
        if load < 2:
            return False  # under any bound: no need to read the others
        total = self.readers.of(targets).total_load()
        return load * len(targets) >= self.bound * total + 2 * len(targets)

    def _expire(self, now: float) -> None:
        sticky = self.sticky
        while sticky:
            key, (target, seen) = next(iter(sticky.items()))
            if now - seen <= self.ttl:
                break
            del sticky[key]
            self.count(target, -1)
