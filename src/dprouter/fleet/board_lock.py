"""The board's lock across serving processes: one decision at a time.

A decision is a read followed by a write: two processes picking at the same
microsecond would both see the same idle rank and both take it. Picking and
counting the pick are one step under a semaphore shared by the serving
processes and the parent (held for the policy's few microseconds, never
across an await); every other write to the board takes it too, which keeps
the board's whole-router rows exact. The board records who holds it, so that
the parent can hand the lock back if a process is killed while holding it.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Protocol

from dprouter.fleet.board import Board

log = logging.getLogger("dprouter")
PATIENCE = 0.5  # seconds to wait for the lock before deciding without it (and saying so)


class Semaphore(Protocol):
    def acquire(self, block: bool = True, timeout: float | None = None) -> bool: ...
    def release(self) -> None: ...


class BoardLock:
    """``holder``: how the board names this process while it holds the lock (a serving
    process: its row + 1; the parent: one more than the rows)."""

    def __init__(self, semaphore: Semaphore, board: Board, holder: int) -> None:
        self.semaphore = semaphore
        self.board = board
        self.holder = holder
        self.held = False

    def __enter__(self) -> None:
        self.held = self.semaphore.acquire(True, PATIENCE)
        if self.held:
            self.board.cells[self.board.lock_cell] = self.holder
        else:  # the parent hands a dead holder's lock back; this is a last resort
            log.error("no board lock within %g s: deciding without it", PATIENCE)

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.held:
            self.held = False
            self.board.cells[self.board.lock_cell] = 0
            self.semaphore.release()


def hand_back(semaphore: Semaphore, board: Board, row: int) -> bool:
    """The process of ``row`` died: if it held the lock, release it for the others."""
    if board.cells[board.lock_cell] != row + 1:
        return False
    board.cells[board.lock_cell] = 0
    semaphore.release()
    return True
