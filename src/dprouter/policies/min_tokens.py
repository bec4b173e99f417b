"""``min_tokens``: the rank with the fewest outstanding tokens (prompt + expected output).

Under DP attention an engine steps at the pace of its busiest rank, so adding
work to the rank with the least outstanding tokens raises no engine's step
time if it can be helped. Ties go to the engine with fewer tokens in total,
then rotate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dprouter.policies.base import PolicyOptions, Readers, RequestInfo
from dprouter.targets import Target


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
        ties = np.flatnonzero(own == own.min())
        if len(ties) == 1:
            return targets[int(ties[0])]
        # among the targets with the fewest tokens, those of the engine with the fewest,
        # the first at or after the rotating start
        engine = reader.engine_tokens(ties)
        among = ties[engine == engine.min()]
        after = int(np.searchsorted(among, self.start % len(targets)))
        return targets[int(among[after] if after < len(among) else among[0])]
