"""``min_tokens``: the rank with the fewest outstanding tokens (prompt + expected output).

Under DP attention an engine steps at the pace of its busiest rank, so adding
work to the rank with the least outstanding tokens raises no engine's step
time if it can be helped. Ties go to the engine with fewer tokens in total,
then rotate.
"""

from __future__ import annotations

from collections.abc import Sequence

from dprouter.policies.base import PolicyOptions, RequestInfo
from dprouter.targets import Target


class MinTokens:
    name = "min_tokens"

    def __init__(self, options: PolicyOptions) -> None:
        self.start = 0

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        n = len(targets)
        self.start += 1
        best = targets[self.start % n]
        best_key = (best.outstanding_tokens, best.worker.outstanding_tokens)
        for i in range(1, n):
            t = targets[(self.start + i) % n]
            key = (t.outstanding_tokens, t.worker.outstanding_tokens)
            if key < best_key:
                best, best_key = t, key
        return best
