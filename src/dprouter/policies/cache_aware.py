"""``cache_aware``: send a prompt where its prefix was sent before, unless load says no.

Each target keeps an LRU set of chained hashes of the 64-character blocks of
prompts it was given (an approximation of the engine's prefix cache). The
target matching the most leading blocks wins (ties: the less loaded) if the
match covers at least ``cache_threshold`` of the prompt; otherwise the least
loaded target does. When loads are imbalanced -- the busiest has more than
``balance_abs`` outstanding over the idlest and more than ``balance_rel`` times
its load -- affinity yields to the least loaded target.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from dprouter.policies.base import PolicyOptions, Readers, RequestInfo, first_least
from dprouter.targets import Target

BLOCK = 64  # characters per block
CAPACITY = 16_384  # blocks remembered per target (~1 MB of prompt text)
MAX, MIN = np.maximum.reduce, np.minimum.reduce


def text_blocks(text: str) -> list[int]:
    hashes: list[int] = []
    prev = 0
    for start in range(0, max(len(text), 1), BLOCK):
        prev = hash((prev, text[start : start + BLOCK]))
        hashes.append(prev)
    return hashes


class CacheAware:
    name = "cache_aware"

    def __init__(self, options: PolicyOptions) -> None:
        self.threshold = options.cache_threshold
        self.balance_abs = options.balance_abs
        self.balance_rel = options.balance_rel
        self.seen: dict[str, OrderedDict[int, None]] = {}  # per target, oldest block first
        self.owners: dict[int, set[str]] = {}  # block -> targets holding it (an inverted index)
        self._pool: Sequence[Target] | None = None
        self._by_label: dict[str, Target] = {}
        self._slots: dict[str, int] = {}  # the pool's targets' board slots, by label
        self.start = 0
        self.readers = Readers()
        # several serving processes: each decision is told to the others, which ``learn`` it
        self.tell: Callable[[Target, list[int]], None] | None = None

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        blocks = text_blocks(request.text)
        if len(targets) == 1:
            chosen = targets[0]
        else:  # every target's load, read once: the balance rule sees them all
            loads = self.readers.of(targets).loads()
            # the ufuncs' own reduce: ndarray.max/min add a Python-level wrapper (measured)
            hi, lo = int(MAX(loads)), int(MIN(loads))
            match = None
            if hi - lo <= self.balance_abs or hi <= self.balance_rel * lo:
                match = self._best_match(targets, blocks)
            chosen = match or targets[first_least(loads, self.start)]
        self._remember(chosen, blocks)
        if self.tell is not None:
            self.tell(chosen, blocks)
        return chosen

    def learn(self, target: Target, blocks: list[int]) -> None:
        """Another serving process sent a prompt of these blocks to ``target``."""
        self._remember(target, blocks)

    def _best_match(self, targets: Sequence[Target], blocks: list[int]) -> Target | None:
        """The least loaded of the targets holding the longest run of leading blocks."""
        if targets is not self._pool:
            self._pool, self._by_label = targets, {t.label: t for t in targets}
            self._slots = {t.label: t.slot for t in targets}
        holders: set[str] | None = None
        depth = 0
        for h in blocks:
            owners = self.owners.get(h)
            if not owners:
                break
            narrower = owners.intersection(self._by_label) if holders is None else holders & owners
            if not narrower:
                break
            holders, depth = narrower, depth + 1
        if holders is None or depth < self.threshold * len(blocks):
            return None
        # the least loaded holder; equal loads: the first label in order
        cells, slots = targets[0].board.load_cells, self._slots
        return self._by_label[min(holders, key=lambda label: (cells[slots[label]], label))]

    def _remember(self, target: Target, blocks: list[int]) -> None:
        seen = self.seen.setdefault(target.label, OrderedDict())
        for h in blocks:
            if h in seen:  # held already, so listed among the block's owners
                seen.move_to_end(h)
            else:
                seen[h] = None
                self.owners.setdefault(h, set()).add(target.label)
        while len(seen) > CAPACITY:
            old, _ = seen.popitem(last=False)
            holders = self.owners[old]
            holders.discard(target.label)
            if not holders:
                del self.owners[old]
