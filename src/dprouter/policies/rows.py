"""One pool's load and token rows of the board, read for a policy that scores every
target (``prefix``) in as few numpy calls as it can: each call on a small array costs
about as much as a pass over thousands."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from dprouter.board import Board
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

    __slots__ = (
        "both",
        "cost",
        "grid",
        "halves",
        "index",
        "into",
        "loads",
        "pool",
        "tokens",
        "where",
    )

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
        rows = board.token_load_base - board.load_base
        self.grid = grid(slots, rows, board.load_base) if n >= GRID else None
        self.into = self.both if self.grid is None else self.both.reshape(self.grid[0])

    def read(self, board: Board) -> None:
        """The board's loads and tokens of the pool, as floats (exact: integers)."""
        if self.grid is None:
            self.both[...] = board.whole[self.index]
        else:
            shape, offset, strides = self.grid
            np.copyto(self.into, np.ndarray(shape, np.int64, board.whole, offset, strides))


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
