"""One decision at a time across serving processes.

The board's counts need no lock (one writer per cell), but a decision is a read
followed by a write: two processes picking at the same microsecond would both
see the same idle rank and both take it. Picking and counting the pick are one
step under a semaphore shared by the serving processes (held for the policy's
few microseconds, never across an await). The board records which row holds
it, so that the parent can hand the turn back if that process is killed while
holding it.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Protocol

from dprouter.board import Board

log = logging.getLogger("dprouter")
PATIENCE = 0.5  # seconds to wait for the turn before deciding without it (and saying so)


class Semaphore(Protocol):
    def acquire(self, block: bool = True, timeout: float | None = None) -> bool: ...
    def release(self) -> None: ...


class Turn:
    def __init__(self, semaphore: Semaphore, board: Board) -> None:
        self.semaphore = semaphore
        self.board = board
        self.held = False

    def __enter__(self) -> None:
        self.held = self.semaphore.acquire(True, PATIENCE)
        if self.held:
            self.board.cells[self.board.turn_cell] = self.board.row + 1
        else:  # the parent hands a dead holder's turn back; this is a last resort
            log.error("no decision turn within %g s: deciding without it", PATIENCE)

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.held:
            self.board.cells[self.board.turn_cell] = 0
            self.semaphore.release()


def hand_back(semaphore: Semaphore, board: Board, row: int) -> bool:
    """The process of ``row`` died: if it held the turn, release it for the others."""
    if board.cells[board.turn_cell] != row + 1:
        return False
    board.cells[board.turn_cell] = 0
    semaphore.release()
    return True
