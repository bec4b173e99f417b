"""The load board: requests and tokens in flight per slot, for the whole router.

Every target and every worker owns a slot. The board keeps, per slot, the
router's requests and tokens in flight, the load the engine reported, the
router's in flight when it reported (``base``), and ``load``: the one number
the policies compare, kept up to date on every change so that a decision reads
one row, at C speed. ``load`` = max(in flight, reported + in flight - base):
the engine's report plus what this router sent (net of what finished) since
that report. For one router alone the engine's report is about its own in
flight, so load is its in flight, exact; beside other replicas it adds the
requests only the engine has seen. Tokens the same way: ``token_load`` =
max(tokens in flight, reported tokens + tokens in flight - ``token_base``),
where the engine reports the KV-cache tokens it holds (and SGLang the prompt
tokens queued) and the router counts prompt + output budget left. ``work``: the
decode tokens its requests there have left to run, by their predicted lengths
(what sets an engine's steps: ``min_tokens`` compares it). ``cap``: the requests
the engine runs at once there (its running slots, as it reports them; 0: not
known), for the dispatcher (``proxy/dispatch``); ``kv``: the tokens its KV cache holds
at most, as the engine reports them (0: not known; the dispatcher's ``--engine-kv``
bound compares the token load with it).

One process keeps the board in a private buffer. ``--processes N`` puts it in
shared memory (made by the parent before the children start) with, besides
the whole-router rows, one row per serving process of what that process has
in flight -- so that the parent can release what a killed process held. Then
every write takes the ``BoardLock`` (a semaphore shared by the processes), so a
request counted in one process is seen by the next decision in any process.

Layout, int64 cells: ``own_inflight[rows][slots]``, ``own_tokens[rows][slots]``,
``own_work[rows][slots]``,
``inflight[slots]``, ``tokens[slots]``, ``reported[slots]``, ``load[slots]``,
``base[slots]``, ``reported_tokens[slots]``, ``token_load[slots]``,
``token_base[slots]``, ``work[slots]``, ``cap[slots]``, ``kv[slots]``, then two
cells: the row (+1)
holding the lock, 0 if none;
the routing keys ``manual`` moved off overloaded targets (one writer: the
process that owns the key table); then ``MODELS`` pairs of cells for the typical
output lengths (``output_budget``): a model's key, its typical length in thousandths;
then the tenants' limits (``proxy/limiter.py``): ``buckets[TENANTS][BUCKETS]`` (a
tenant name's hash, 0: free; two token buckets, each a level and when it was last
filled) and ``own_flights[rows][TENANTS]``, each process's requests in flight per
tenant (a killed process's are released with its other rows); last, for the
dispatcher under ``--processes`` (``proxy/heads.py``), ``own_heads[rows][slots]``: per
process and slot, the key of the first request it holds for that slot (its class and
place in line, packed; higher first; 0: none), and ``looked[rows]``: when the process
last looked at its line while it holds requests (milliseconds of ``time.monotonic``,
one clock for every process of the host; 0: it holds none).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Protocol

import numpy as np
import numpy.typing as npt


class Lock(Protocol):
    """What every write takes under ``--processes`` (``board_lock.BoardLock``); ``held``:
    this process holds it already (a decision counting its pick)."""

    held: bool

    def __enter__(self) -> None: ...

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None: ...


SLOTS = 1 << 15  # targets + workers a router can hold (4,096 ranks is 1/8 of it)
I64 = npt.NDArray[np.int64]
ROWS = 11  # whole-router rows
MODELS = 64  # models whose typical output length the board keeps (more: kept per process)


TENANTS = 4096  # tenants with limits the board keeps at once (``proxy/limiter.py``)
BUCKETS = 5  # a tenant's cells: its name's hash, then two token buckets (level, stamp)


def size_of(rows: int, slots: int = SLOTS, tenants: int = TENANTS) -> int:
    cells = (4 * rows + ROWS) * slots + 2 + 2 * MODELS + (BUCKETS + rows) * tenants + rows
    return cells * 8


class Board:
    def __init__(
        self,
        rows: int = 1,
        row: int = 0,
        slots: int = SLOTS,
        buffer: memoryview | bytearray | None = None,
        lock: Lock | None = None,
        tenants: int = TENANTS,
    ) -> None:
        self.rows, self.row, self.slots = rows, row, slots
        self.lock = lock  # shared: every write takes it (the writer may hold it already)
        size = size_of(rows, slots, tenants)
        raw = memoryview(buffer if buffer is not None else bytearray(size))
        self._view = raw[:size]
        raw.release()
        self.cells = self._view.cast("q")  # one cell at a time, at C speed
        whole: I64 = np.frombuffer(self._view, np.int64)
        self.whole = whole  # every cell: a gather over two rows reads both in one step
        own = rows * slots
        self.own_inflight = whole[:own].reshape(rows, slots)
        self.own_tokens = whole[own : 2 * own].reshape(rows, slots)
        self.own_work = whole[2 * own : 3 * own].reshape(rows, slots)
        top = 3 * own  # the whole-router rows, after the three per-process blocks
        (
            self.inflight,
            self.tokens,
            self.reported,
            self.load,
            self.base,
            self.reported_tokens,
            self.token_load,
            self.token_base,
            self.work,
            self.cap,
            self.kv,
        ) = (whole[top + i * slots : top + (i + 1) * slots] for i in range(ROWS))
        self.mine = row * slots  # where this process's own rows start
        self.mine_tokens = own + row * slots
        self.mine_work = 2 * own + row * slots
        self.inflight_base = top
        self.tokens_base = top + slots
        self.reported_base = top + 2 * slots
        self.load_base = top + 3 * slots
        self.base_base = top + 4 * slots
        self.reported_tokens_base = top + 5 * slots
        self.token_load_base = top + 6 * slots
        self.token_base_base = top + 7 * slots
        self.work_base = top + 8 * slots
        self.cap_base = top + 9 * slots
        self.kv_base = top + 10 * slots
        self.lock_cell = top + ROWS * slots
        self.moves_cell = self.lock_cell + 1
        self.models_base = self.moves_cell + 1  # MODELS x (key, typical x 1000)
        # tenants with limits: per tenant its buckets, and per process its requests in flight
        buckets = self.models_base + 2 * MODELS
        self.buckets = whole[buckets : buckets + BUCKETS * tenants].reshape(tenants, BUCKETS)
        flights = buckets + BUCKETS * tenants
        self.own_flights = whole[flights : flights + rows * tenants].reshape(rows, tenants)
        # the dispatcher's held requests: per process, its first in line's key per slot
        heads = flights + rows * tenants
        self.own_heads = whole[heads : heads + rows * slots].reshape(rows, slots)
        self.looked_base = heads + rows * slots  # read a cell at a time: a few rows
        self.looked = whole[self.looked_base : self.looked_base + rows]
        # the rows policies read, one cell per slot (an itemgetter over slots reads many)
        self.load_cells = self.cells[self.load_base : self.load_base + slots]
        self.token_load_cells = self.cells[self.token_load_base : self.token_load_base + slots]
        self._free: list[int] = []
        self._next = 0

    def close(self) -> None:
        """Let go of the buffer (shared memory cannot be closed while views of it live)."""
        del self.whole, self.own_inflight, self.own_tokens, self.own_work, self.inflight
        del self.tokens
        del self.reported, self.load, self.base, self.reported_tokens, self.token_load
        del self.token_base, self.work, self.cap, self.kv, self.buckets, self.own_flights
        del self.own_heads, self.looked
        self.load_cells.release()
        self.token_load_cells.release()
        self.cells.release()
        self._view.release()

    # -- reading --------------------------------------------------------------------

    def inflight_of(self, slot: int) -> int:
        return self.cells[self.inflight_base + slot]

    def tokens_of(self, slot: int) -> int:
        return self.cells[self.tokens_base + slot]

    def reported_of(self, slot: int) -> int:
        return self.cells[self.reported_base + slot]

    def load_of(self, slot: int) -> int:
        return self.cells[self.load_base + slot]

    def reported_tokens_of(self, slot: int) -> int:
        return self.cells[self.reported_tokens_base + slot]

    def token_load_of(self, slot: int) -> int:
        return self.cells[self.token_load_base + slot]

    def work_of(self, slot: int) -> int:
        return self.cells[self.work_base + slot]

    def cap_of(self, slot: int) -> int:
        return self.cells[self.cap_base + slot]

    def kv_of(self, slot: int) -> int:
        return self.cells[self.kv_base + slot]

    @property
    def moves(self) -> int:
        return self.cells[self.moves_cell]

    # -- writing --------------------------------------------------------------------

    def step(self) -> AbstractContextManager[object]:
        """A write of several cells in one step for all processes: the lock, unless there is
        none (one process) or this process holds it already (a decision's count)."""
        lock = self.lock
        return lock if lock is not None and not lock.held else nullcontext()

    def moved(self) -> None:
        """A routing key left an overloaded target."""
        self.cells[self.moves_cell] += 1

    def add(self, slot: int, requests: int, tokens: int, also: int = -1, work: int = 0) -> None:
        """Count ``requests``, ``tokens`` and decode ``work`` on ``slot`` (and on ``also``:
        a target's worker, in the same step). ``step`` written out: this runs twice per
        request."""
        lock = self.lock
        if lock is None or lock.held:
            self._add(slot, requests, tokens, also, work)
        else:
            with lock:
                self._add(slot, requests, tokens, also, work)

    def _add(self, slot: int, requests: int, tokens: int, also: int, work: int) -> None:
        """Both slots in one body, the offsets read once: a request's four writes (two
        per ``add``) at 1.7 us less than a call per slot (timeit)."""
        c = self.cells
        rows, mine, mine_tokens, mine_work = self.rows, self.mine, self.mine_tokens, self.mine_work
        inflight, toks, reported = self.inflight_base, self.tokens_base, self.reported_base
        load, base = self.load_base, self.base_base
        reported_toks, token_load = self.reported_tokens_base, self.token_load_base
        token_base, works = self.token_base_base, self.work_base
        while True:
            if rows > 1:
                c[mine + slot] += requests
                c[mine_tokens + slot] += tokens
            n = c[inflight + slot] + requests
            c[inflight + slot] = n
            seen = c[reported + slot] + n - c[base + slot]
            c[load + slot] = n if n > seen else seen
            t = c[toks + slot] + tokens
            c[toks + slot] = t
            seen = c[reported_toks + slot] + t - c[token_base + slot]
            c[token_load + slot] = t if t > seen else seen
            if work:
                c[works + slot] += work
                if rows > 1:
                    c[mine_work + slot] += work
            if also < 0:
                return
            slot, also = also, -1

    def set_inflight(self, slot: int, value: int) -> None:
        """Make the router's count ``value`` (counted as this process's)."""
        self.add(slot, value - self.inflight_of(slot), 0)

    def set_tokens(self, slot: int, value: int) -> None:
        self.add(slot, 0, value - self.tokens_of(slot))

    def report(self, slot: int, value: int, tokens: int = 0) -> None:
        """What the engine says runs and waits there, and the tokens it holds (0: it
        does not say; then the router's own count is the token load)."""
        with self.step():
            self._report(slot, value, tokens)

    def _report(self, slot: int, value: int, tokens: int) -> None:
        c = self.cells
        c[self.reported_base + slot] = value
        n = c[self.inflight_base + slot]
        c[self.base_base + slot] = n
        c[self.load_base + slot] = n if n > value else value
        c[self.reported_tokens_base + slot] = tokens
        t = c[self.tokens_base + slot]
        c[self.token_base_base + slot] = t
        c[self.token_load_base + slot] = t if t > tokens else tokens

    def set_kv(self, slot: int, tokens: int) -> None:
        """The tokens ``slot``'s KV cache holds at most (0: not known). One cell, as
        ``set_cap``."""
        self.cells[self.kv_base + slot] = tokens

    def set_cap(self, slot: int, cap: int) -> None:
        """The requests the engine runs at once on ``slot`` (0: not known). One cell:
        written whole, read whole, no lock needed."""
        self.cells[self.cap_base + slot] = cap

    def release(self, row: int) -> None:
        """A serving process died: what it had in flight is in flight no more."""
        with self.step():
            self._release(row)

    def _release(self, row: int) -> None:
        self.inflight -= self.own_inflight[row]
        self.tokens -= self.own_tokens[row]
        self.work -= self.own_work[row]
        np.maximum(self.inflight, self.reported + self.inflight - self.base, out=self.load)
        seen = self.reported_tokens + self.tokens - self.token_base
        np.maximum(self.tokens, seen, out=self.token_load)
        self.own_inflight[row, :] = 0
        self.own_tokens[row, :] = 0
        self.own_work[row, :] = 0
        self.own_flights[row, :] = 0  # its tenants' requests in flight too
        self.looked[row] = 0  # and the requests it held
        self.own_heads[row, :] = 0

    # -- slots: handed out by the one process that owns membership ------------------

    def take(self) -> int:
        """A free slot. A freed one is reused only once nothing is in flight on it (a
        request on a removed worker still finishes and decrements its old slot)."""
        for i, slot in enumerate(self._free):
            if not self.cells[self.inflight_base + slot] and not self.tokens_of(slot):
                del self._free[i]
                self.report(slot, 0)
                self.set_cap(slot, 0)
                self.set_kv(slot, 0)
                return slot
        if self._next >= self.slots:
            raise RuntimeError(f"the router holds at most {self.slots} targets and workers")
        self._next += 1
        return self._next - 1

    def give(self, slot: int) -> None:
        self._free.append(slot)
