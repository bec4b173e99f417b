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
import numpy.typing as npt

from dprouter.board import Board
from dprouter.policies.base import CACHED, PolicyOptions, RequestInfo, first_least
from dprouter.targets import Target

F64 = npt.NDArray[np.float64]
GRID = 512  # pools from this size read a grid by strides, not a gather (measured)


class Rows:
    """One pool's load and token rows, read in one step into a kept float buffer (each
    numpy call on a small array costs about as much as a pass over thousands: the fewer
    calls, the faster), and its positions by label.

    The read is a gather of the pool's cells, or, for a large pool laid out as a grid
    (equal-DP workers registered together: the registry interleaves them rank by rank, so
    the k-th target's slot is first + rank x a + worker x b), one strided copy, which
    costs half as much as the gather and the cast at 4,096 targets."""

    __slots__ = ("both", "cost", "grid", "halves", "index", "loads", "pool", "tokens", "where")

    def __init__(self, pool: Sequence[Target]) -> None:
        board, n = pool[0].board, len(pool)
        slots = np.array([t.slot for t in pool], np.intp)
        # positions in ``board.whole``: the pool's loads, then its tokens
        self.index = np.concatenate([slots + board.load_base, slots + board.token_load_base])
        self.halves = np.array([0, n], np.intp)
        self.pool = pool
        self.both: F64 = np.empty(2 * n)
        self.loads, self.tokens = self.both[:n], self.both[n:]
        self.cost: F64 = np.empty(n)
        self.where = {t.label: i for i, t in enumerate(pool)}  # positions, by label
        self.grid = grid(slots, board.token_load_base - board.load_base, board.load_base)
        if n < GRID:
            self.grid = None

    def read(self, board: Board) -> None:
        """The board's loads and tokens of the pool, as floats (exact: integers)."""
        if self.grid is None:
            self.both[...] = board.whole[self.index]
        else:
            shape, offset, strides = self.grid
            np.copyto(
                self.both.reshape(shape), np.ndarray(shape, np.int64, board.whole, offset, strides)
            )


def grid(
    slots: npt.NDArray[np.intp], rows: int, base: int
) -> tuple[tuple[int, int, int], int, tuple[int, int, int]] | None:
    """The pool's two rows as a (2, ranks, workers) strided view of the board (shape,
    byte offset, byte strides), if its slots are first + rank x a + worker x b."""
    n = len(slots)
    if n < 2:
        return None
    b = int(slots[1] - slots[0])
    steps = np.flatnonzero(np.diff(slots) != b)
    width = int(steps[0]) + 1 if len(steps) else n
    if n % width or b <= 0:
        return None
    depth = n // width
    a = int(slots[width] - slots[0]) if depth > 1 else 1
    first = int(slots[0])
    expected = first + a * np.arange(depth)[:, None] + b * np.arange(width)[None, :]
    if a <= 0 or not np.array_equal(expected.ravel(), slots):
        return None
    item = np.dtype(np.int64).itemsize
    return (2, depth, width), (base + first) * item, (rows * item, a * item, b * item)


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

    def rows(self, pool: Sequence[Target]) -> Rows:
        """Kept by pool (identity: a snapshot's pools are kept tuples)."""
        found = self._rows.get(id(pool))
        if found is None or found.pool is not pool:
            if len(self._rows) >= CACHED:
                self._rows.clear()
            found = self._rows[id(pool)] = Rows(pool)
        return found

    def select(self, targets: Sequence[Target], request: RequestInfo) -> Target:
        self.start += 1
        if len(targets) == 1:
            return targets[0]
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
