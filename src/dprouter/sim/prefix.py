"""Prefix cache of one rank: an LRU set of chained token-block hashes.

Block i's hash covers blocks 0..i, so a hit on block i implies the whole
prefix up to it matches; a lookup walks from the first block and stops at the
first miss, as vLLM's hash-based prefix caching does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``ids`` (a partial tail is never cached)."""
    hashes: list[int] = []
    prev = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        prev = hash((prev, *ids[start : start + block_size]))
        hashes.append(prev)
    return hashes


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """Number of leading blocks (at most ``limit``) present; touches them."""
        n = 0
        blocks = self._blocks
        for h in hashes[:limit]:
            if h not in blocks:
                break
            blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        if self.capacity <= 0:
            return
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
