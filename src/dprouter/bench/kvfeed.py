"""The simulated ranks' KV-cache events, fed to a router's index in virtual time.

Each offline rank's prefix cache keeps a journal of what it stored, evicted and
cleared; at the end of every step the journal is encoded as the engine publishes it
(vLLM's wire format), and ``delay`` virtual seconds later it is decoded and applied to
a ``KvIndex`` -- so the index is what the events say, a little late, never a peek at
the caches. A lookup then gives ``RequestInfo.prefix`` as the router's request path
does, from the prompt's token ids (offline arrivals carry them: no tokenizer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from dprouter.kvevents import wire
from dprouter.kvevents.index import KvIndex
from dprouter.kvevents.keys import prompt_keys
from dprouter.policies import Prefix
from dprouter.sim.kvevents import encode_batch
from dprouter.sim.rank import Rank
from dprouter.targets import Target

DELAY = 0.005  # seconds from a step's end to its events in the index (ZMQ, decode)


class SimKvFeed:
    def __init__(self, workers: Sequence[str], delay: float = DELAY) -> None:
        self.workers = list(workers)  # engine index -> worker id
        self.delay = delay
        self.index = KvIndex()
        self.batches = 0
        self._queue: deque[tuple[float, str, int, bytes]] = deque()  # in due order
        self._ranks: tuple[Sequence[Target] | None, int, dict[int, tuple[int, dict[int, str]]]]
        self._ranks = (None, -1, {})

    def collect(self, engine: int, ranks: Sequence[Rank], now: float) -> None:
        """Take what the ranks' caches recorded: one batch per rank with news."""
        for rank in ranks:
            events = rank.cache.take_events()
            if events:
                payload = encode_batch(now, events, rank.index, "vllm", "map")
                self._queue.append((now + self.delay, self.workers[engine], rank.index, payload))

    def deliver(self, now: float) -> None:
        queue, index = self._queue, self.index
        while queue and queue[0][0] <= now:
            _, worker, dp_rank, payload = queue.popleft()
            index.apply(index.rank(worker, dp_rank), wire.batch(payload).events)
            self.batches += 1

    def prefix(self, pool: Sequence[Target], ids: Sequence[int], now: float) -> Prefix | None:
        """What each target of ``pool`` holds of the prompt (``kvevents.lookup``'s
        ``Lookup.prefix``, without the tokenising)."""
        self.deliver(now)
        ranks = self._by_block_size(pool)
        if not ranks or not ids:
            return None
        array = np.asarray(ids, dtype=np.int64)
        held: dict[str, int] = {}
        for size, (among, labels) in ranks.items():
            for bit, blocks in self.index.match(prompt_keys(array, size), among).items():
                held[labels[bit]] = blocks * size
        return Prefix(len(ids), held)

    def _by_block_size(self, pool: Sequence[Target]) -> dict[int, tuple[int, dict[int, str]]]:
        kept, version, found = self._ranks
        if kept is pool and version == self.index.version:
            return found
        found = {}
        for t in pool:
            rank = self.index.ranks.get((t.worker.id, t.rank or 0))
            if rank is not None and rank.block_size:
                mask, labels = found.get(rank.block_size, (0, {}))
                labels[rank.bit] = t.label
                found[rank.block_size] = (mask | 1 << rank.bit, labels)
        self._ranks = (pool, self.index.version, found)
        return found
