"""``min_tokens``: the rank with the least token load.

Under DP attention an engine steps at the pace of its busiest rank, so adding
work to the rank with the least outstanding tokens raises no engine's step
time if it can be helped. Token load is the board's: prompt + output budget
left of the router's requests, or what the engine reports holding plus what
was sent since, if more. Ties go to the engine with the least, then rotate.
"""

from __future__ import annotations

from collections.abc import Sequence

from dprouter.fleet.targets import Target
from dprouter.policies import kernels
from dprouter.policies.base import PolicyOptions, RequestInfo, readers


class MinTokens:
    name = "min_tokens"

    def __init__(self, options: PolicyOptions) -> None:
        self.start = 0
        self.readers = readers()

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        if len(targets) == 1:
            return targets[0]
        reader = self.readers.of(targets)
        # a compiled scan of the board's token row through the pool's slots and its
        # workers' (numpy's gather, argmin, ties and their engines' gather: ~24 us at 4,096)
        start = self.start % len(targets)
        board = reader.board
        return targets[
            kernels.fewest_tokens(
                board.token_load, reader.index, reader.worker_index, start, reader.scratch
            )
        ]
