"""What each target of a pool holds of a request's prompt (``RequestInfo.prefix``), and
what the router sends where (pending blocks): one ``Matcher`` for the router's request
path and the offline benchmark's feed alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dprouter.core.types import Incoming, Kind
from dprouter.engines.kvevents.index import KvIndex, Rank
from dprouter.engines.kvevents.keys import prompt_keys, root
from dprouter.engines.kvevents.prompt import Tokens, asked, for_request
from dprouter.fleet.targets import Target
from dprouter.policies import Prefix

Group = tuple[int, str | None]  # (block size, dialect): one chain of keys for the prompt


@dataclass(frozen=True)
class Ranks:
    """A pool's ranks in the index, and its models' ``/v1/models`` parents (adapters')."""

    groups: dict[Group, tuple[int, dict[int, str]]]  # -> (mask of bits, label by bit)
    by_label: dict[str, tuple[Rank, Group]]
    parents: dict[str, str | None]


@dataclass(frozen=True)
class Found:
    """A prompt looked up: what the policy reads, and its keys for ``Matcher.sent``."""

    prefix: Prefix
    keys: dict[Group, list[int]]  # the prompt's block keys
    ranks: Ranks


class PendingRow:
    """``Prefix.queued`` read off the index: its row of pending tokens by rank bit,
    gathered in a pool's order (one numpy step; the pool's bits kept per pool)."""

    def __init__(self, index: KvIndex) -> None:
        self.index = index
        self._cached: tuple[Sequence[Target] | None, int, npt.NDArray[np.intp]]
        self._cached = (None, -1, np.zeros(0, np.intp))

    def of(self, targets: Sequence[Target]) -> npt.NDArray[np.int64]:
        index = self.index
        kept, version, bits = self._cached
        if kept is not targets or version != index.version:
            none = len(index.queue) - 1  # always 0: no rank in the index
            found = (index.ranks.get((t.worker.id, t.rank or 0)) for t in targets)
            bits = np.array([none if r is None else r.bit for r in found], np.intp)
            self._cached = (targets, index.version, bits)
        return index.queue[bits]


class Matcher:
    def __init__(self, index: KvIndex) -> None:
        self.index = index
        self.queued = PendingRow(index)
        self._cached: tuple[Sequence[Target] | None, int, Ranks]
        self._cached = (None, -1, Ranks({}, {}, {}))

    def ranks(self, pool: Sequence[Target]) -> Ranks:
        """Kept while the pool (a snapshot's tuple) and the index's ranks are the same."""
        kept, version, found = self._cached
        if kept is pool and version == self.index.version:
            return found
        found = Ranks({}, {}, {})
        for t in pool:
            rank = self.index.ranks.get((t.worker.id, t.rank or 0))
            if rank is not None and rank.block_size:
                group = (rank.block_size, t.worker.dialect)
                mask, labels = found.groups.get(group, (0, {}))
                labels[rank.bit] = t.label
                found.groups[group] = (mask | 1 << rank.bit, labels)
                found.by_label[t.label] = (rank, group)
            for card in t.worker.cards.values():
                parent = card.get("parent")
                found.parents.setdefault(card["id"], parent if isinstance(parent, str) else None)
        self._cached = (pool, self.index.version, found)
        return found

    def match(
        self,
        pool: Sequence[Target],
        ids: npt.NDArray[np.integer],
        now: float,
        adapters: Mapping[str | None, str | None] | None = None,
    ) -> Found:
        """``ids`` against what the pool's ranks hold or have pending, at ``now``; sent to
        ``adapters[dialect]`` (None or missing: the base model), whose blocks chain apart."""
        ranks = self.ranks(pool)
        keys: dict[Group, list[int]] = {}
        chains: dict[tuple[int, int], list[int]] = {}  # (size, root): dialects that agree share
        for group in ranks.groups:
            size, start = group[0], root(adapters.get(group[1]) if adapters else None)
            if (size, start) not in chains:
                chains[size, start] = prompt_keys(ids, size, start)
            keys[group] = chains[size, start]
        return self._held(len(ids), keys, ranks, now)

    def again(self, found: Found, now: float) -> Found:
        """``found``'s prompt looked up once more: what was sent since counts as pending."""
        return self._held(found.prefix.tokens, found.keys, found.ranks, now)

    def _held(self, tokens: int, keys: dict[Group, list[int]], ranks: Ranks, now: float) -> Found:
        """What each rank of ``ranks`` holds of the prompt's ``keys`` (pending counted)."""
        index = self.index
        index.expire(now)
        held: dict[str, int] = {}
        stored: dict[str, int] | None = {} if index.pending else None
        for group, (among, labels) in ranks.groups.items():
            size = group[0]
            done: dict[int, int] | None = {} if stored is not None else None
            for bit, blocks in index.match(keys[group], among, done).items():
                held[labels[bit]] = blocks * size
            if stored is not None and done:  # some blocks pending somewhere: what is stored
                for bit, blocks in done.items():
                    stored[labels[bit]] = blocks * size
        queued = self.queued if index.pending else None
        return Found(Prefix(tokens, held, queued, stored), keys, ranks)

    def sent(self, found: Found, target: Target, now: float) -> None:
        """The prompt went to ``target``: its blocks not held there are pending there."""
        known = found.ranks.by_label.get(target.label)
        if known is not None and self.index.ranks.get(known[0].name) is known[0]:
            self.index.expect(known[0], found.keys[known[1]], now)


class Lookup:
    """The request path's side: the prompt tokenised as its model's engine does, looked up
    in the chain of the adapter the engine would run it with."""

    def __init__(
        self, tokens: Mapping[str | None, Tokens], index: KvIndex, pool: ThreadPoolExecutor
    ) -> None:
        self.tokens = tokens
        self.index = index
        self.matcher = Matcher(index)
        self.pool = pool  # where long prompts are encoded

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def find(
        self, kind: Kind, incoming: Incoming, pool: Sequence[Target], now: float
    ) -> Found | None:
        ranks = self.matcher.ranks(pool)
        if not ranks.groups:
            return None  # nothing to match against: not even tokenised
        wanted = {d: asked(d, incoming, ranks.parents) for _, d in ranks.groups}
        tokens = for_request(self.tokens, incoming, next(iter(wanted.values())).base)
        if tokens is None:
            return None
        ids = await tokens.ids(kind, incoming.body)
        if ids is None or not len(ids):
            return None
        adapters = {d: a.adapter for d, a in wanted.items()}
        return self.matcher.match(pool, ids, now, adapters)  # the index may have moved meanwhile

    def sent(self, found: Found, target: Target, now: float) -> None:
        self.matcher.sent(found, target, now)

    def again(self, found: Found, now: float) -> Found:
        return self.matcher.again(found, now)
