"""``min_tokens``: the rank where a request adds the least decode work.

Under DP attention an engine steps until its busiest rank is done, and a rank's
steps are set by its decode tokens and its running slots: a request's prompt
costs one prefill chunk, its output one step per token. A rank's cost is the
board's ``work`` (the output tokens the router's requests there have left to
run, each by its predicted length -- ``output_budget``: exact under
``ignore_eos``, a group's history, the model's typical length -- spent as a
stream passes) plus, for each request the rank holds (``load``: the router's in
flight, or the engine's report plus what was sent since), the new request's own
predicted output: the slots are shared, so every request there delays the new
one or shares its steps. An earlier cost, prompt + output budget, balanced
prompt characters in an RL burst while the decode tokens that set the steps
stayed unbalanced (busiest/mean 1.24, worse than round robin's 1.10 on a real
SGLang); work alone, with no count of requests, piled short requests on one rank
past its running cap (28 queued on a rank of 32 slots in the simulated RL step,
against 4). Under the dispatcher (``proxy/dispatch``) the targets offered are
those with a free slot. Ties go to the target whose engine holds the fewest
tokens (``token_load``), then rotate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dprouter.fleet.targets import Target
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
        board, index = reader.board, reader.index
        # numpy's gathers and comparisons over the pool (~10 us at 4,096)
        cost = board.work[index] + max(request.output, 1) * board.load[index]
        tied = np.flatnonzero(cost == cost.min())
        if len(tied) > 1:
            held = board.token_load[index[tied]]
            tied = tied[held == held.min()]
        at = int(np.searchsorted(tied, self.start % len(targets)))
        return targets[int(tied[at] if at < len(tied) else tied[0])]
