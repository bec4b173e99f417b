"""Which rank holds which block: the index the engines' events build.

Every block is known by its key (``keys``: its whole token prefix), so the same prompt
held by two ranks, or two engines with different hash seeds, is one entry. An entry
packs, in one int, the ranks holding the key as a bit mask (one bit per rank, bits
reused as ranks come and go) above the key's depth in tokens (its parent's depth is
what a child's key needs). Each rank keeps its engine's block hashes -> keys, for
``BlockRemoved`` and for chaining a stored block to its parent; nothing is held that
the rank did not say it holds, and a rank dropped is emptied at once.

Memory is bounded: past ``capacity`` (blocks over all ranks) new blocks are not
indexed -- the index then under-reports, which costs a cache miss, never a wrong
claim. About 200 bytes a block held by one rank (docs/kv-events.md: measured).

Pending blocks are the router's own knowledge beside the events': a prompt's blocks
sent to a rank that its events have not stored yet (``expect``). They count as held
there, and as prefill queued there, until the rank's events store them, until a
removal, a flush or the rank's end says otherwise, or ``ttl`` seconds at the latest --
so a pending block never outlives what the events say.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dprouter.engines.kvevents.keys import chain, root
from dprouter.engines.kvevents.wire import Cleared, Event, Hash, Removed, Stored

DEPTH_BITS = 32
DEPTH = (1 << DEPTH_BITS) - 1
PENDING_TTL = 10.0  # seconds: longer than a long prompt's queue and prefill (measured)
GPU = (None, "GPU", "gpu")  # what a prompt can hit at once; a CPU tier's blocks are not counted


@dataclass(eq=False)
class Rank:
    """One rank's blocks, as its events said."""

    name: tuple[str, int]  # (worker id, dp rank)
    bit: int
    blocks: dict[Hash, int] = field(default_factory=dict)  # engine hash -> key
    block_size: int = 0  # 0: no block stored yet
    orphans: int = 0  # blocks stored under a parent never seen (a replay may bring it)
    pending: dict[int, float] = field(default_factory=dict)  # key -> when it expires


@dataclass
class Counts:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    dropped: int = 0  # blocks not indexed: over capacity
    ignored: int = 0  # events of another medium, group or token kind


class KvIndex:
    def __init__(self, capacity: int = 4_000_000, ttl: float = PENDING_TTL) -> None:
        self.capacity = capacity
        self.ttl = ttl  # pending blocks expire after this many seconds (0: none kept)
        self.entries: dict[int, int] = {}  # key -> holders mask << DEPTH_BITS | depth
        self.pending: dict[int, int] = {}  # key -> mask of the ranks it is pending on
        # pending tokens by rank bit, for a pool to gather in one step; the last entry
        # stays 0, for the pool's targets with no rank in the index
        self.queue = np.zeros(64, np.int64)
        self._expiry: deque[tuple[float, Rank, int]] = deque()  # in expiry order
        self.ranks: dict[tuple[str, int], Rank] = {}
        # each worker's block size, as configured or as its first event said: a rank of it
        # sizes its blocks before it publishes, so what a router sends there can be pending
        self.block_sizes: dict[str, int] = {}
        self.size = 0  # blocks held over all ranks
        self.version = 0  # bumped when a rank joins, leaves or sizes its blocks
        self.counts = Counts()
        self._free: list[int] = []
        self._next = 0

    def rank(self, worker: str, dp_rank: int) -> Rank:
        name = (worker, dp_rank)
        found = self.ranks.get(name)
        if found is None:
            bit = self._free.pop() if self._free else self._next
            self._next += bit == self._next
            found = self.ranks[name] = Rank(name, bit, block_size=self.block_sizes.get(worker, 0))
            if bit + 2 > len(self.queue):
                self.queue = np.concatenate([self.queue, np.zeros_like(self.queue)])
            self.version += 1
        return found

    def _size(self, worker: str, block_size: int) -> None:
        """One engine, one block size: every rank of ``worker`` takes it."""
        self.block_sizes[worker] = block_size
        for rank in self.ranks.values():
            if rank.name[0] == worker and rank.block_size != block_size:
                rank.block_size = block_size
        self.version += 1  # lookups group ranks by block size

    def expect_size(self, worker: str, block_size: int) -> None:
        """The worker's configured block size (``kv_block_size``), until an event says."""
        if worker not in self.block_sizes:
            self._size(worker, block_size)

    def drop(self, worker: str, dp_rank: int) -> None:
        """The rank's stream is gone: it holds nothing the router knows of."""
        found = self.ranks.pop((worker, dp_rank), None)
        if found is not None:
            self.clear(found)
            self._free.append(found.bit)
            self._free.sort(reverse=True)  # the lowest bit first: masks stay small
            self.version += 1

    def apply(self, rank: Rank, events: Iterable[Event]) -> None:
        for e in events:
            if isinstance(e, Stored):
                self.store(rank, e)
            elif isinstance(e, Removed):
                if e.medium in GPU and e.group in (None, 0):
                    self.remove(rank, e.hashes)
                else:
                    self.counts.ignored += 1
            elif isinstance(e, Cleared):
                self.clear(rank)
                self.counts.cleared += 1

    def store(self, rank: Rank, e: Stored) -> None:
        n = len(e.hashes)
        if (
            e.medium not in GPU
            or e.group not in (None, 0)
            or n == 0
            or len(e.tokens) != n * e.block_size
            or not isinstance(e.tokens[0], int)
        ):
            self.counts.ignored += 1
            return
        if e.parent is None:
            parent, depth = root(e.lora), 0
        else:
            known = rank.blocks.get(e.parent)
            if known is None:
                rank.orphans += n
                self.counts.orphans += n
                return
            parent, depth = known, self.entries[known] & DEPTH
        if rank.block_size != e.block_size:
            self._size(rank.name[0], e.block_size)
        bit, entries = 1 << rank.bit, self.entries
        for i, (h, key) in enumerate(
            zip(e.hashes, chain(parent, depth, e.tokens, e.block_size), strict=True)
        ):
            if h in rank.blocks:
                continue
            if self.size >= self.capacity:
                self.counts.dropped += n - i
                return
            rank.blocks[h] = key
            if rank.pending:
                self._settle(rank, key)
            held = entries.get(key, 0) >> DEPTH_BITS
            entries[key] = (held | bit) << DEPTH_BITS | (depth + (i + 1) * e.block_size)
            self.size += 1
            self.counts.stored += 1

    def remove(self, rank: Rank, hashes: Iterable[Hash]) -> None:
        for h in hashes:
            key = rank.blocks.pop(h, None)
            if key is not None:
                if rank.pending:
                    self._settle(rank, key)
                self._release(key, ~(1 << rank.bit))
                self.size -= 1
                self.counts.removed += 1

    def clear(self, rank: Rank) -> None:
        keep = ~(1 << rank.bit)
        for key in rank.blocks.values():
            self._release(key, keep)
        self.size -= len(rank.blocks)
        rank.blocks = {}
        rank.orphans = 0
        keep, pending = ~(1 << rank.bit), self.pending
        for key in rank.pending:
            if held := pending[key] & keep:
                pending[key] = held
            else:
                del pending[key]
        rank.pending = {}
        self.queue[rank.bit] = 0

    def expect(self, rank: Rank, keys: Sequence[int], now: float) -> None:
        """The prompt whose block keys are ``keys`` was sent to ``rank`` at ``now``: its
        blocks the rank does not hold are pending there."""
        self.expire(now)
        if not self.ttl:
            return
        bit, until = 1 << rank.bit, now + self.ttl
        entries, pending, mine = self.entries, self.pending, rank.pending
        for key in keys:
            if (entries.get(key, 0) >> DEPTH_BITS) & bit:
                continue
            mine.pop(key, None)  # a key sent again moves to the back: dicts keep order
            mine[key] = until
            pending[key] = pending.get(key, 0) | bit
            self._expiry.append((until, rank, key))
        self.queue[rank.bit] = len(mine) * rank.block_size

    def expire(self, now: float) -> None:
        """Pending blocks past their time are dropped (O(1) each)."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            until, rank, key = expiry.popleft()
            if rank.pending.get(key) == until:
                self._settle(rank, key)

    def queued(self, rank: Rank) -> int:
        """Tokens of ``rank``'s pending blocks: prefill sent there and not yet done."""
        return len(rank.pending) * rank.block_size

    def _settle(self, rank: Rank, key: int) -> None:
        """``key`` is no longer pending on ``rank`` (stored, removed or expired)."""
        if rank.pending.pop(key, None) is not None:
            self.queue[rank.bit] = len(rank.pending) * rank.block_size
            if held := self.pending[key] & ~(1 << rank.bit):
                self.pending[key] = held
            else:
                del self.pending[key]

    def _release(self, key: int, keep: int) -> None:
        entry = self.entries[key]
        held = (entry >> DEPTH_BITS) & keep
        if held:
            self.entries[key] = held << DEPTH_BITS | (entry & DEPTH)
        else:
            del self.entries[key]

    def match(
        self, keys: Iterable[int], among: int, stored: dict[int, int] | None = None
    ) -> dict[int, int]:
        """How many of the leading ``keys`` each rank of the mask ``among`` holds or has
        pending, by rank bit (ranks holding none are left out): O(blocks matched).
        ``stored``, if given, gets the same of what each holds as its events stored it
        (pending blocks left out), in the same walk."""
        held: dict[int, int] = {}
        alive, entries, pending = among, self.entries, self.pending
        done = among if stored is not None else 0  # within alive: stored is held
        depth = 0
        for key in keys:
            mask = entries.get(key, 0) >> DEPTH_BITS
            holders = mask & alive
            if pending:
                holders |= pending.get(key, 0) & alive
            if done:
                kept = mask & done
                if depth and stored is not None:
                    _note(stored, done & ~kept, depth)
                done = kept
            if depth:
                _note(held, alive & ~holders, depth)
            alive = holders
            if not alive:
                return held
            depth += 1
        _note(held, alive, depth)
        if stored is not None:
            _note(stored, done, depth)
        return held


def _note(out: dict[int, int], bits: int, depth: int) -> None:
    """``out[bit] = depth`` for each bit set in ``bits``."""
    while bits:
        low = bits & -bits
        out[low.bit_length() - 1] = depth
        bits ^= low
