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

from dprouter.policies.base import PolicyOptions, Readers, RequestInfo, first_least
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
        self.readers = Readers()
        self._pool: Sequence[Target] | None = None
        self._where: dict[str, int] = {}  # the pool's positions, by label

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        if len(targets) == 1:
            return targets[0]
        reader = self.readers.of(targets)
        loads, tokens = reader.loads(), reader.tokens()
        # the score negated, as cost (the same floats: negation is exact); an integer
        # sum over n is the float mean exactly, without numpy's slow mean()
        n = len(targets)
        mean_load = int(loads.sum()) / n
        cost = loads * self.load_weight
        cost /= mean_load + 1
        load_tokens = tokens * self.token_weight
        load_tokens /= int(tokens.sum()) / n + request.tokens + 1
        cost += load_tokens
        prefix = request.prefix
        if prefix is None:
            return targets[first_least(cost, self.start)]
        if targets is not self._pool:
            self._pool, self._where = targets, {t.label: i for i, t in enumerate(targets)}
        if prefix.queued is not None and self.queue_weight:
            queued = prefix.queued.of(targets) * (self.queue_weight / (request.tokens + 1))
            cost += queued
        if prefix.tokens and prefix.held and self.weight:
            limit = self.bound * (mean_load + 1)
            for label, held in prefix.held.items():
                i = self._where.get(label)
                if i is not None and loads[i] <= limit:
                    cost[i] -= self.weight * held / prefix.tokens
        return targets[first_least(cost, self.start)]
