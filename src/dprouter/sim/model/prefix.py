"""Prefix cache of one rank: an LRU set of chained token-block hashes.

Block i's hash covers blocks 0..i, so a hit on block i implies the whole
prefix up to it matches; a lookup walks from the first block and stops at the
first miss, as vLLM's hash-based prefix caching does.

With ``record`` on, the cache keeps a journal of what entered and left it (the
engines' KV events); the engine takes it once per step. Off, it costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dprouter.sim.model.kvevents import Adapter, Cleared, KvEvent, Removed, Stored


def block_hashes(ids: Sequence[int], block_size: int, lora: Adapter | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``ids`` (a partial tail is never cached); an
    adapter's chain starts apart, as the engines put its name in the first block's hash."""
    hashes: list[int] = []
    prev = 0 if lora is None else hash(("lora", lora.name))
    for start in range(0, len(ids) - block_size + 1, block_size):
        prev = hash((prev, *ids[start : start + block_size]))
        hashes.append(prev)
    return hashes


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int = 16, record: bool = False) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.journal: list[KvEvent] | None = [] if record else None

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def blocks(self) -> list[int]:
        """The hashes held, least recently used first."""
        return list(self._blocks)

    def take_events(self) -> list[KvEvent]:
        """What happened since the last call (one engine step's batch)."""
        if not self.journal:
            return []
        events, self.journal = self.journal, []
        return events

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

    def insert(
        self, hashes: Sequence[int], ids: Sequence[int] = (), lora: Adapter | None = None
    ) -> None:
        """Cache the full blocks of a prompt (``ids``: its tokens, ``lora``: its adapter,
        for the journal)."""
        if self.capacity <= 0:
            return
        blocks = self._blocks
        journal = self.journal
        run: Stored | None = None  # the run of new blocks being recorded
        for i, h in enumerate(hashes):
            if h in blocks:
                blocks.move_to_end(h)
                run = None
                continue
            blocks[h] = None
            if journal is None:
                continue
            tokens = list(ids[i * self.block_size : (i + 1) * self.block_size])
            if run is None:
                run = Stored([], hashes[i - 1] if i else None, [], self.block_size, lora)
                journal.append(run)
            run.block_hashes.append(h)
            run.token_ids.extend(tokens)
        evicted: list[int] = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        if evicted and journal is not None:
            journal.append(Removed(evicted))

    def clear(self) -> None:
        self._blocks.clear()
        if self.journal is not None:
            self.journal.append(Cleared())
