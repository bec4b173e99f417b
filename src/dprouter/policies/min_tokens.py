"""``min_tokens``: the rank with the least token load.

Under DP attention an engine steps at the pace of its busiest rank, so adding
work to the rank with the least outstanding tokens raises no engine's step
time if it can be helped. Token load is the board's: prompt + output budget
left of the router's requests, or what the engine reports holding plus what
was sent since, if more. Ties go to the engine with the least, then rotate.
"""

from __future__ import annotations

from collections.abc import Sequence

from dprouter.policies.base import PolicyOptions, Readers, RequestInfo
from dprouter.targets import Target

FEW = 16  # ties up to this many are broken in Python (measured)


class MinTokens:
    name = "min_tokens"

    def __init__(self, options: PolicyOptions) -> None:
        self.start = 0
        self.readers = Readers()

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        if len(targets) == 1:
            return targets[0]
        reader = self.readers.of(targets)
        own = reader.tokens()
        first = int(own.argmin())
        found = (own == own[first]).nonzero()[0]
        if len(found) == 1:
            return targets[first]
        # among the targets with the fewest tokens, those of the engine with the fewest:
        # the first at or after the rotating start
        r = self.start % len(targets)
        if len(found) < FEW:  # a few ties: Python beats numpy's per-call cost
            cells, slots = reader.board.token_load_cells, reader.worker_slots
            ties: list[int] = found.tolist()
            engine = [cells[slots[i]] for i in ties]
            fewest = min(engine)
            among = [i for i, e in zip(ties, engine, strict=True) if e == fewest]
            return targets[next((i for i in among if i >= r), among[0])]
        tied = reader.engine_tokens(found)
        picked = found[tied == tied[tied.argmin()]]
        after = int(picked.searchsorted(r))
        return targets[int(picked[after] if after < len(picked) else picked[0])]
