"""``min_tokens``: the rank with the fewest outstanding tokens (prompt + expected output).

Under DP attention an engine steps at the pace of its busiest rank, so adding
work to the rank with the least outstanding tokens raises no engine's step
time if it can be helped. Ties go to the engine with fewer tokens in total,
then rotate.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from dprouter.policies.base import PolicyOptions, RequestInfo, rotated
from dprouter.targets import Target


class MinTokens:
    name = "min_tokens"

    def __init__(self, options: PolicyOptions) -> None:
        self.start = 0

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        return min(rotated(targets, self.start), key=_tokens)


# the target's tokens, then its engine's: read at C speed (a Python key function costs
# about three times as much per target, which shows at thousands of targets)
_tokens = attrgetter("outstanding_tokens", "worker.outstanding_tokens")
