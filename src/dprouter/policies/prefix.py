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
and request tokens the prompt's plus its output estimate (each term computed as the
weight over its divisor, times the target's count: ``kernels.prefix_pick``, one compiled
pass). In the queue term request tokens are never fewer than the prompt's as tokenised
(``Prefix.tokens``), the unit of queued and held: the estimate counts a prompt's
characters / 4, half the tokens of a chat of made-up words (``tests/test_pd_prefix.py``),
which weighed a queued token twice against a held one and moved conversations off their
ranks. The highest score wins; ties go to the first from a rotating start. Defaults 4,
1.5, 1, 1, 1 (bench prefix: at 1 a one-request difference in load moved a conversation
off its rank).

Over a prefill pool (P/D) whose KV events are all followed, the queue term stands for the
load and token terms (their weights count 0): a prefill-only rank's work ahead is the
prefill queued there, which the queue counts in the tokens still to compute, while its
requests in flight and their tokens count the same prompts again, cached blocks as if
computed. With no decode to keep a conversation there between turns, a prefill rank's
load swings with each arrival -- three turns at once on one rank, none on the next -- and
those terms moved turns off the rank holding them (docs/pd.md, 16 in flight). The bound
still reads requests in flight: it is what spreads a group's samples over prefill ranks.

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
import numpy.typing as npt

from dprouter.fleet.targets import Target
from dprouter.policies import kernels
from dprouter.policies.base import ByPool, PolicyOptions, RequestInfo, first_least

NONE: npt.NDArray[np.int64] = np.zeros(0, np.int64)  # no prefill queued anywhere
LARGE = 2048  # pools from this size find the least cost with numpy (measured)
# what a block being computed (pending) is worth beside a stored one: the samples of a GRPO
# group, sent together, find their prompt pending where the first went; counted in full
# they filled that rank past the others, whose DP-attention steps then waited on it
PENDING_WORTH = 0.65


class Rows:
    """One pool's board slots and positions by label, with kept buffers for a decision
    (packed: ``kernels.prefix_pick`` unpacks each array argument at a cost)."""

    __slots__ = ("at", "bonus", "cost", "floats", "followed", "ints", "pool", "where")

    def __init__(self, pool: Sequence[Target]) -> None:
        n = len(pool)
        self.pool = pool
        # the slots; the loads and tokens read; the holders' positions
        self.ints: npt.NDArray[np.int64] = np.zeros((4, n), np.int64)
        self.ints[0] = [t.slot for t in pool]
        self.floats: npt.NDArray[np.float64] = np.zeros((2, n))  # the costs; the bonuses
        self.where = {t.label: i for i, t in enumerate(pool)}
        # every worker's KV events followed: its queue is known (one that publishes none
        # reads 0 queued, and, its load not counted, would look free to every prompt)
        self.followed = all(t.worker.kv_events is not None for t in pool)
        self.at, self.bonus, self.cost = self.ints[3], self.floats[1], self.floats[0]  # views


class PrefixPolicy:
    name = "prefix"
    needs_tokens = True

    def __init__(self, options: PolicyOptions) -> None:
        # floats, whatever the config file wrote (1 is an int): the kernel was compiled for
        # floats, and another type would compile it again on a request
        self.weight = float(options.prefix_weight)
        self.bound = float(options.prefix_bound)
        self.load_weight = float(options.load_weight)
        self.token_weight = float(options.token_weight)
        self.queue_weight = float(options.queue_weight)
        self.start = 0
        self.rows = ByPool(Rows)

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        if len(targets) == 1:
            return targets[0]
        rows = self.rows.of(targets)
        held = 0
        queued = NONE
        load_weight, token_weight = self.load_weight, self.token_weight
        queue_weight = self.queue_weight
        prefix = request.prefix
        if prefix is not None:
            if prefix.queued is not None and queue_weight:
                queued = prefix.queued.of(targets)
                # per request token, never fewer than the prompt's as tokenised (the
                # estimate's prompt is its characters / 4): the kernel divides by the
                # estimate, so the weight is scaled to it
                if prefix.tokens > request.tokens:
                    queue_weight *= (request.tokens + 1.0) / (prefix.tokens + 1.0)
            if queue_weight and targets[0].worker.role == "prefill" and rows.followed:
                # a prefill-only rank's work ahead is the prefill queued there: its
                # requests in flight and their tokens count the same prompts again
                load_weight = token_weight = 0.0
            if prefix.tokens and self.weight:
                where, at, bonus = rows.where, rows.at, rows.bonus
                stored = prefix.stored
                for label, tokens in prefix.held.items():
                    i = where.get(label)
                    if i is not None:  # the bonus in one Python float (the same IEEE steps)
                        worth: float = tokens
                        if stored is not None:  # blocks being computed count for less
                            done = stored.get(label, 0)
                            worth = done + PENDING_WORTH * (tokens - done)
                        at[held], bonus[held] = i, self.weight * worth / prefix.tokens
                        held += 1
        board = targets[0].board
        start = self.start % len(targets)
        large = len(targets) >= LARGE
        # one compiled pass over the board (numpy took ten calls, ~35 us at 4,096)
        found = kernels.prefix_pick(
            board.whole,
            board.load_base,
            board.token_load_base,
            rows.ints,
            rows.floats,
            queued,
            int(request.tokens),
            load_weight,
            token_weight,
            queue_weight,
            self.bound,
            held,
            -1 if large else start,
        )
        return targets[first_least(rows.cost, start) if large else found]
