"""What each target of a pool holds of a request's prompt: ``RequestInfo.prefix``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from dprouter.kvevents.index import KvIndex
from dprouter.kvevents.keys import prompt_keys
from dprouter.kvevents.prompt import Tokens, for_request
from dprouter.parse import Incoming, Kind
from dprouter.policies import Prefix
from dprouter.targets import Target

# a pool's ranks in the index: block size -> (mask of their bits, label by bit)
Ranks = dict[int, tuple[int, dict[int, str]]]


class Lookup:
    def __init__(
        self, tokens: Mapping[str | None, Tokens], index: KvIndex, pool: ThreadPoolExecutor
    ) -> None:
        self.tokens = tokens
        self.index = index
        self.pool = pool  # where long prompts are encoded
        self._cached: tuple[Sequence[Target] | None, int, Ranks] = (None, -1, {})

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def ranks(self, pool: Sequence[Target]) -> Ranks:
        """Kept while the pool (a snapshot's tuple) and the index's ranks are the same."""
        kept, version, found = self._cached
        if kept is pool and version == self.index.version:
            return found
        found = {}
        for t in pool:
            rank = self.index.ranks.get((t.worker.id, t.rank or 0))
            if rank is not None and rank.block_size:
                mask, labels = found.get(rank.block_size, (0, {}))
                labels[rank.bit] = t.label
                found[rank.block_size] = (mask | 1 << rank.bit, labels)
        self._cached = (pool, self.index.version, found)
        return found

    async def prefix(self, kind: Kind, incoming: Incoming, pool: Sequence[Target]) -> Prefix | None:
        tokens = for_request(self.tokens, incoming)
        if tokens is None or not self.ranks(pool):
            return None  # nothing to match against: not even tokenised
        ids = await tokens.ids(kind, incoming.body)
        if ids is None or not len(ids):
            return None
        held: dict[str, int] = {}
        for size, (among, labels) in self.ranks(pool).items():  # the index may have moved
            for bit, blocks in self.index.match(prompt_keys(ids, size), among).items():
                held[labels[bit]] = blocks * size
        return Prefix(len(ids), held)
