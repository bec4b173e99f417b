"""``cache_aware``: send a prompt where its prefix was sent before, unless load says no.

Each target keeps an LRU set of chained hashes of the 64-byte blocks of
prompts it was given (an approximation of the engine's prefix cache: a prompt's
deepest blocks are evicted first, as vLLM's are, so a target always holds a leading run
of what it holds part of, and the longest held run is found by bisection). The
target matching the most leading blocks wins (ties: the less loaded) if the
match covers at least ``cache_threshold`` of the prompt; otherwise the least
loaded target does. Affinity holds while the holder's load is at most
``cache_bound`` x (the pool's mean load + 1); past it the least loaded target
takes the request -- and the prompt's blocks with it, so a hot prefix spreads over
more targets as the fleet's load grows instead of piling onto one. (The rule was
the SGLang gateway's: yield only once the busiest had 32 requests over the idlest
and 1.5x its load; a hot 20k-token system prompt at concurrency 64 put 33 of the
first 64 requests on one rank of 16.) The blocks are hashed per model, adapter included
(``RequestInfo.model``): the engine caches each adapter's KV apart, so one system prompt
sent to many adapters does not pile them all onto the rank that first saw it.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from dprouter.fleet.targets import Target
from dprouter.policies import kernels
from dprouter.policies.base import PolicyOptions, RequestInfo, readers

I64 = npt.NDArray[np.int64]

CAPACITY = 16_384  # blocks remembered per target (~1 MB of prompt text)


def text_blocks(text: str, scratch: I64 | None = None, model: str | None = None) -> list[int]:
    """Block i's hash covers blocks 0..i, so equal hashes mean an equal prefix. Compiled
    (``kernels.block_hashes``): the same in every process whatever its hash seed, and a
    20k-token system prompt costs ~50 us where hashing it block by block in Python cost
    180. ``scratch``: where the kernel writes (a new array if it is too short). ``model``
    (adapter included) sets every hash apart, as an engine keeps each adapter's KV apart:
    one prompt sent to two adapters matches neither's blocks."""
    raw = text.encode("utf-8", "surrogatepass")  # JSON may carry a lone surrogate
    need = len(raw) // kernels.BLOCK + 1
    if scratch is None or len(scratch) < need:
        scratch = np.empty(need, np.int64)
    n = kernels.block_hashes(raw, scratch)
    if model is not None:
        scratch[:n] ^= model_seed(model)  # an equal prefix is still an equal chain
    hashes: list[int] = scratch[:n].tolist()
    return hashes


@functools.lru_cache(maxsize=1024)  # the models a router serves: few; a client's own: bounded
def model_seed(model: str) -> int:
    """A model's 64 bits, the same in every serving process (they tell each other blocks)."""
    digest = hashlib.blake2b(model.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class CacheAware:
    name = "cache_aware"

    def __init__(self, options: PolicyOptions) -> None:
        self.threshold = options.cache_threshold
        self.bound = float(options.cache_bound)  # one compiled signature, ints from a config too
        self.seen: dict[str, OrderedDict[int, None]] = {}  # per target, oldest block first
        self.owners: dict[int, set[str]] = {}  # block -> targets holding it (an inverted index)
        self._pool: Sequence[Target] | None = None
        self._labels: frozenset[str] = frozenset()  # so ``owners & labels`` walks the smaller
        self._slots: dict[str, int] = {}  # the pool's targets' board slots, by label
        self._position: dict[str, int] = {}  # the pool's targets' places in it, by label
        self.capacity = CAPACITY  # blocks remembered per target
        self._scratch: I64 = np.empty(1024, np.int64)  # the block hashes of prompts to 64 kB
        self.start = 0
        self.readers = readers()
        # several serving processes: each decision is told to the others, which ``learn`` it
        self.tell: Callable[[Target, list[int]], None] | None = None

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        blocks = text_blocks(request.text, self._scratch, request.adapter)
        if len(targets) == 1:
            chosen = targets[0]
        else:
            reader = self.readers.of(targets)
            # the balance rule sees every target's load: one compiled pass sums the pool's
            # and, past the bound, finds the least loaded from the rotating start
            chosen = targets[
                kernels.affinity(
                    reader.board.load,
                    reader.index,
                    self._best_match(targets, blocks),
                    self.bound,
                    self.start % len(targets),
                )
            ]
        self._remember(chosen, blocks)
        if self.tell is not None:
            self.tell(chosen, blocks)
        return chosen

    def learn(self, target: Target, blocks: list[int]) -> None:
        """Another serving process sent a prompt of these blocks to ``target``."""
        self._remember(target, blocks)

    def _best_match(self, targets: Sequence[Target], blocks: list[int]) -> int:
        """Where in the pool the least loaded of the targets holding the longest run of
        leading blocks is (-1: no run long enough)."""
        if targets is not self._pool:
            self._pool = targets
            self._labels = frozenset(t.label for t in targets)
            self._slots = {t.label: t.slot for t in targets}
            self._position = {t.label: i for i, t in enumerate(targets)}
        depth = self._depth(blocks)
        if not depth or depth < self.threshold * len(blocks):
            return -1
        holders = self.owners[blocks[depth - 1]] & self._labels
        if len(holders) == 1:
            (label,) = holders
            return self._position[label]
        # the least loaded holder; equal loads: the first label in order
        cells, slots = targets[0].board.load_cells, self._slots
        return self._position[min(holders, key=lambda label: (cells[slots[label]], label))]

    def _depth(self, blocks: list[int]) -> int:
        """How many leading blocks a target of the pool holds. A target holding a block
        holds every block before it (``_remember``), so the blocks some target holds are a
        leading run and its end is found by bisection: the first block and the last, then
        ~log2(blocks) more, where walking the run took a set test per block. The holders
        of the last block of the run are then the targets holding all of it."""
        get, labels = self.owners.get, self._labels
        owners = get(blocks[0])
        if owners is None or labels.isdisjoint(owners):
            return 0
        n = len(blocks)
        owners = get(blocks[-1])
        if owners is not None and not labels.isdisjoint(owners):
            return n  # the usual case of a prompt held before: two lookups
        low, high = 1, n - 1  # block low - 1 is held, block high is not
        while low < high:
            mid = (low + high) // 2
            owners = get(blocks[mid])
            if owners is not None and not labels.isdisjoint(owners):
                low = mid + 1
            else:
                high = mid
        return low

    def _remember(self, target: Target, blocks: list[int]) -> None:
        label = target.label
        seen = self.seen.get(label)
        if seen is None:
            seen = self.seen[label] = OrderedDict()
        move, owners = seen.move_to_end, self.owners
        # the deepest block first, so each block is newer than the blocks after it and is
        # evicted after them (as vLLM frees a request's blocks, tail first): a target holds
        # a leading run of every prompt it holds part of, which ``_depth`` relies on
        for h in reversed(blocks):
            if h in seen:  # held already, so listed among the block's owners
                move(h)
            else:
                seen[h] = None
                holders = owners.get(h)
                if holders is None:
                    owners[h] = {label}
                else:
                    holders.add(label)
        while len(seen) > self.capacity:
            old, _ = seen.popitem(last=False)
            holders = owners[old]
            holders.discard(label)
            if not holders:
                del owners[old]
