"""The heads of queue the serving processes show each other under ``--processes``, so that
the dispatcher's order (``dispatch.py``: the class, then the longest predicted first, aged)
holds for the whole router, not for each process.

Each process keeps its own queue; a slot that frees in one process would go to its own
first in line, whatever the others hold. So each process puts on the board, per target,
the **key** of the first request it holds for it (``key``: the class, then the place in
line, packed in one cell, the higher first), and the time it last looked at its queue
(``Board.looked``). A request takes a slot on a target only where no other process shows
a better key (an equal one: the lower row first); the process that shows the best takes
the slot at its next look (within ``POLL_SHARED``, 5 ms, of the slot freeing).

Bounds. A process that dies has its rows cleared by the parent (``Board.release``). One
that stops looking (its event loop stuck) is passed over once its stamp is ``STALE`` old,
so it holds a slot back that long at most. A first in line that cannot take the slot that
freed (it samples ``n`` and waits for ``n`` on one rank; a class kept off the reserve)
holds back the requests behind it in every process, as one queue would; the slots it
waits for free as the running requests end. Nothing held in any process: a request reads
one cell per process (``others``): a request's look and count took 11.3-11.6 us of CPU,
13.1-13.6 before this was shared (the old look scanned them with numpy).

Tenants' shares. Each process picks its first in line by the shares of its own tenants;
the key compares the class and the place in line only, so across processes the better
first in line goes first. Shares hold for the whole router as far as each tenant's
requests spread over the processes (the kernel spreads connections at random; a tenant
whose requests come on one kept-alive connection is held in one process, and beside
another tenant held in the other its share is not kept). Keeping them exactly would put
each tenant's count of slots served on the board and every first in line's key would
move with it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from dprouter.fleet.board import Board

ORDER = 1 << 50  # a key's place in line: tokens of the dispatcher's order, centred
CLASSES = 1 << 12  # classes a key tells apart (the 4,096th and those below compare alike)
STALE = 500  # milliseconds after which a process's keys are passed over: it stopped looking
Index = npt.NDArray[np.intp]
Shown = tuple[Board, Index, int]  # a pool held here: the board, its targets, its first's key


def key(priority: int, order: float) -> int:
    """A held request's key: its class (``priority``, 0 the highest) first, then its
    ``order`` (the dispatcher's: aging x arrival - predicted output, in tokens, the less
    first) to the token; the higher goes first, and none is 0 (the board's nothing)."""
    place = min(max((ORDER >> 1) - math.floor(order), 0), ORDER - 1)
    return (CLASSES - min(priority, CLASSES - 1)) * ORDER + place


def stamp() -> int:
    """A look's time: milliseconds of ``time.monotonic``, one clock for every process of
    the host (the event loop's too, which the requests' arrivals are read off)."""
    return int(time.monotonic() * 1000) or 1


class Heads:
    """What this process shows on the board; what the others show."""

    def __init__(self) -> None:
        self.shown: list[Shown] = []

    def show(self, heads: list[Shown]) -> None:
        """Put ``heads`` on the board (per pool held here; a target's cell, the best of its
        pools') in one step, and stamp the look. Unchanged: the stamp alone, one cell
        written whole (no lock); nothing held and nothing shown: nothing."""
        # the readers' own arrays, by identity (those shown are held: no id is reused)
        if [(id(i), k) for _, i, k in heads] == [(id(i), k) for _, i, k in self.shown]:
            if heads:
                board = heads[0][0]
                board.looked[board.row] = stamp()
            return
        board = (heads or self.shown)[0][0]  # every pool's is the registry's
        with board.step():
            mine = board.own_heads[board.row]
            for _, index, _ in self.shown:
                mine[index] = 0
            for _, index, best in heads:
                mine[index] = np.maximum(mine[index], best)
            board.looked[board.row] = stamp() if heads else 0
        self.shown = heads

    @staticmethod
    def others(board: Board) -> list[int] | None:
        """The rows of the other processes that hold requests and looked within ``STALE``;
        None: none. What a request pays when nothing is held: a cell read per row."""
        cells, base, row = board.cells, board.looked_base, board.row
        rows = [r for r in range(board.rows) if r != row and cells[base + r]]
        if not rows:
            return None
        since = stamp() - STALE
        rows = [r for r in rows if cells[base + r] > since]
        return rows or None

    @staticmethod
    def clear(board: Board, rows: list[int], index: Index, mine: int) -> Any:
        """Per target of ``index``: whether no process of ``rows`` shows a key better than
        ``mine`` there (an equal one: the lower row goes first)."""
        heads, row = board.own_heads, board.row
        room: Any = True
        for r in rows:  # a row at a time: a gather each, cheaper than one over all rows
            room = room & (heads[r, index] <= mine - (r < row))
        return room
