"""The simulated ranks' KV-cache events, fed to a router's index in virtual time.

Each offline rank's prefix cache keeps a journal of what it stored, evicted and
cleared; at the end of every step the journal is encoded as the engine publishes it
(vLLM's wire format), and ``delay`` virtual seconds later it is decoded and applied to
a ``KvIndex`` -- so the index is what the events say, a little late, never a peek at
the caches. A lookup then gives ``RequestInfo.prefix`` as the router's request path
does, from the prompt's token ids (offline arrivals carry them: no tokenizer), with the
same ``Matcher``; and the blocks of the prompt routed are pending on its target after
the decision, as the router's request path records them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from dprouter.engines.kvevents import wire
from dprouter.engines.kvevents.index import KvIndex
from dprouter.engines.kvevents.lookup import Found, Matcher
from dprouter.fleet.targets import Target
from dprouter.sim.model.kvevents import encode_batch
from dprouter.sim.model.rank import Rank

DELAY = 0.005  # seconds from a step's end to its events in the index (ZMQ, decode)


class SimKvFeed:
    def __init__(self, workers: Sequence[str], delay: float = DELAY) -> None:
        self.workers = list(workers)  # engine index -> worker id
        self.delay = delay
        self.index = KvIndex()
        self.batches = 0
        self._queue: deque[tuple[float, str, int, bytes]] = deque()  # in due order
        self.matcher = Matcher(self.index)

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

    def prefix(self, pool: Sequence[Target], ids: Sequence[int], now: float) -> Found | None:
        """What each target of ``pool`` holds or has pending of the prompt, as the router's
        ``Lookup.find`` gives it (without the tokenising)."""
        self.deliver(now)
        if not ids or not self.matcher.ranks(pool).groups:
            return None
        return self.matcher.match(pool, np.asarray(ids, dtype=np.int64), now)

    def sent(self, found: Found, target: Target, now: float) -> None:
        """The router sent the prompt to ``target``: as ``Lookup.sent``."""
        self.matcher.sent(found, target, now)
