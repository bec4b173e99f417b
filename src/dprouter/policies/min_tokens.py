"""``min_tokens``: the rank with the fewest outstanding tokens (prompt + expected output).

Under DP attention an engine steps at the pace of its busiest rank, so adding
work to the rank with the least outstanding tokens raises no engine's step
time if it can be helped. Ties go to the engine with fewer tokens in total,
then rotate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dprouter.policies.base import PolicyOptions, Readers, RequestInfo, first_least
from dprouter.targets import Target

SMALL = 128  # pools below this are scanned as lists (measured)
NONE = 1 << 62  # not a candidate


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
        if len(targets) < SMALL:  # Python's list min and index beat numpy's per-call cost
            listed: list[int] = own.tolist()
            least = min(listed)
            if listed.count(least) == 1:
                return targets[listed.index(least)]
            engine: list[int] = reader.engine_tokens().tolist()
            keys = [e if o == least else NONE for o, e in zip(listed, engine, strict=True)]
            return targets[first_least(keys, self.start)]
        ties = np.flatnonzero(own == own.min())
        if len(ties) == 1:
            return targets[int(ties[0])]
        # among the targets with the fewest tokens, those of the engine with the fewest,
        # the first at or after the rotating start
        tied = reader.engine_tokens(ties)
        among = ties[tied == tied.min()]
        after = int(np.searchsorted(among, self.start % len(targets)))
        return targets[int(among[after] if after < len(among) else among[0])]
