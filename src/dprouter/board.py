"""The load board: requests and tokens in flight per slot, one row per serving process.

Every target and every worker owns a slot. A serving process writes only its
own row (no lock: one writer per cell) and readers sum the rows, so a request
counted in one process is seen by the next decision in any process. The
engine-reported load has one row of its own, written by whoever scrapes (the
control plane). One process uses a private buffer; ``--processes N`` puts the
same layout in shared memory made by the parent before the children start.

Layout, int64 cells: ``inflight[rows][slots]``, ``tokens[rows][slots]``,
``reported[slots]``, then ``turn``: the row (+1) deciding now, 0 if none.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

SLOTS = 1 << 15  # targets + workers a router can hold (4,096 ranks is 1/8 of it)
I64 = npt.NDArray[np.int64]


def size_of(rows: int, slots: int = SLOTS) -> int:
    return (2 * rows + 1) * slots * 8 + 8  # and one cell: which row holds the turn


class Board:
    def __init__(
        self,
        rows: int = 1,
        row: int = 0,
        slots: int = SLOTS,
        buffer: memoryview | bytearray | None = None,
    ) -> None:
        self.rows, self.row, self.slots = rows, row, slots
        raw = memoryview(buffer if buffer is not None else bytearray(size_of(rows, slots)))
        self._view = raw[: size_of(rows, slots)]
        raw.release()
        self.cells = self._view.cast("q")  # the writer's fast path
        whole: I64 = np.frombuffer(self._view, np.int64)
        self.inflight = whole[: rows * slots].reshape(rows, slots)
        self.tokens = whole[rows * slots : 2 * rows * slots].reshape(rows, slots)
        self.reported = whole[2 * rows * slots : (2 * rows + 1) * slots]
        self.mine = row * slots  # where this process's inflight row starts
        self.token_base = rows * slots + row * slots
        self.reported_base = 2 * rows * slots
        self.turn_cell = (2 * rows + 1) * slots
        self._free: list[int] = []
        self._next = 0

    def close(self) -> None:
        """Let go of the buffer (shared memory cannot be closed while views of it live)."""
        del self.inflight, self.tokens, self.reported
        self.cells.release()
        self._view.release()

    # -- reading: the whole router --------------------------------------------------

    def inflight_of(self, slot: int) -> int:
        if self.rows == 1:
            return self.cells[slot]
        return int(self.inflight[:, slot].sum())

    def tokens_of(self, slot: int) -> int:
        if self.rows == 1:
            return self.cells[self.slots + slot]
        return int(self.tokens[:, slot].sum())

    def reported_of(self, slot: int) -> int:
        return self.cells[self.reported_base + slot]

    # -- writing: this process's row (and the reported row, by the control plane) ---

    def add(self, slot: int, requests: int, tokens: int) -> None:
        self.cells[self.mine + slot] += requests
        self.cells[self.token_base + slot] += tokens

    def set_inflight(self, slot: int, value: int) -> None:
        """Make the whole router's count ``value`` by adjusting this process's cell."""
        self.cells[self.mine + slot] += value - self.inflight_of(slot)

    def set_tokens(self, slot: int, value: int) -> None:
        self.cells[self.token_base + slot] += value - self.tokens_of(slot)

    def report(self, slot: int, value: int) -> None:
        self.cells[self.reported_base + slot] = value

    def release(self, row: int) -> None:
        """A serving process died: what it had in flight is in flight no more."""
        self.inflight[row, :] = 0
        self.tokens[row, :] = 0

    # -- slots: handed out by the one process that owns membership ------------------

    def take(self) -> int:
        """A free slot. A freed one is reused only once nothing is in flight on it (a
        request on a removed worker still finishes and decrements its old slot)."""
        for i, slot in enumerate(self._free):
            if not self.inflight[:, slot].any() and not self.tokens[:, slot].any():
                del self._free[i]
                self.report(slot, 0)
                return slot
        if self._next >= self.slots:
            raise RuntimeError(f"the router holds at most {self.slots} targets and workers")
        self._next += 1
        return self._next - 1

    def give(self, slot: int) -> None:
        self._free.append(slot)
