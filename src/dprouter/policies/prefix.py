"""``prefix``: the target whose engine holds most of the prompt, weighed against load.

What each target holds comes from its engine's KV-cache events (``kvevents``), in
``RequestInfo.prefix``: ``held`` of the prompt's ``tokens``, in leading blocks, counting
blocks the router sent there that the events have not stored yet (pending), and
``queued``, each target's pending tokens: prefill sent there and not yet done (one
numpy row, so its cost does not grow with the targets in Python). Each
target scores

    score = prefix_weight x held / prompt x [load <= prefix_bound x (mean load + 1)]
            - load_weight x load / (mean load + 1)
            - token_weight x tokens / (mean tokens + request tokens + 1)
            - queue_weight x queued / (request tokens + 1)

where load is requests in flight and tokens the token load (the board's: the router's
own count, or the engine's report when it knows of more), means over the candidates,
and request tokens the prompt's plus its output estimate. The highest score wins; ties
go to the first from a rotating start. Defaults 4, 1.5, 1, 1, 1 (bench prefix: at 1 a
one-request difference in load moved a conversation off its rank).

The bound is what spreads a hot prefix: once its holder is loaded past the bound its
prefix stops counting, the next request goes where load says, that rank stores the
prefix too, and from then on the two share it by load -- so a prefix spreads over more
ranks as their load grows instead of piling onto one. The queue term keeps a prompt
that must be computed off a rank already computing one (its first token would wait for
the other's). With nothing held it is load balancing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dprouter.policies.base import CACHED, PolicyOptions, RequestInfo, first_least
from dprouter.policies.rows import Rows
from dprouter.targets import Target


class PrefixPolicy:
    name = "prefix"
    needs_tokens = True

    def __init__(self, options: PolicyOptions) -> None:
        self.weight = options.prefix_weight
        self.bound = options.prefix_bound
        self.load_weight = options.load_weight
        self.token_weight = options.token_weight
        self.queue_weight = options.queue_weight
        self.start = 0
        self._rows: dict[int, Rows] = {}
        self.last: Rows | None = None  # the last decision's pool

    def rows(self, pool: Sequence[Target]) -> Rows:
        """Kept by pool (identity: a snapshot's pools are kept tuples)."""
        found = self._rows.get(id(pool))
        if found is None or found.pool is not pool:
            if len(self._rows) >= CACHED:
                self._rows.clear()
            found = self._rows[id(pool)] = Rows(pool)
        self.last = found
        return found

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        if len(targets) == 1:
            return targets[0]
        rows = self.last
        if rows is None or rows.pool is not targets:
            rows = self.rows(targets)
        rows.read(targets[0].board)
        # the sums of integers (well below 2^53) are exact in floats, whatever the order:
        # over n, the float means exactly, without numpy's slow mean()
        load_sum, token_sum = np.add.reduceat(rows.both, rows.halves).tolist()
        n = len(targets)
        mean_load = load_sum / n
        # the score negated, as cost, in the same float steps as the formula (negation
        # is exact): load x weight / (mean load + 1) + tokens x weight / (...)
        loads, tokens, cost = rows.loads, rows.tokens, rows.cost
        if self.load_weight != 1.0:  # x 1.0 is exact: skipped
            np.multiply(loads, self.load_weight, out=cost)
            cost /= mean_load + 1
        else:
            np.divide(loads, mean_load + 1, out=cost)
        if self.token_weight != 1.0:
            tokens *= self.token_weight
        tokens /= token_sum / n + request.tokens + 1
        cost += tokens
        prefix = request.prefix
        if prefix is None:
            return targets[first_least(cost, self.start)]
        if prefix.queued is not None and self.queue_weight:
            cost += prefix.queued.of(targets) * (self.queue_weight / (request.tokens + 1))
        if prefix.tokens and prefix.held and self.weight:
            # the few holders' bonuses, one Python float each (the same IEEE steps)
            limit = self.bound * (mean_load + 1)
            where = rows.where
            for label, held in prefix.held.items():
                i = where.get(label)
                if i is not None and loads.item(i) <= limit:
                    cost[i] = cost.item(i) - self.weight * held / prefix.tokens
        return targets[first_least(cost, self.start)]
