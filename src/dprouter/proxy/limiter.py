"""Tenants' limits: requests per second and tokens per second as token buckets, and
requests in flight, each exact for the whole router.

The buckets and the counts live on the board (``fleet/board.py``): in shared memory
under ``--processes``, where every change takes the board's lock, so N serving
processes hold a tenant to its limit as one would. Across replicas each holds it
alone (docs/security.md). A bucket holds ``burst`` seconds of its rate and starts full;
a request larger than a whole bucket passes when the bucket is full and leaves it in
debt, so the rate holds on average and no request is refused forever. The clock is
CLOCK_MONOTONIC, one for every process of the machine.

A request's tokens (prompt + output budget) are known only once its body is read:
``Entry.charge`` is called then (``proxy/read.py``); the request and in-flight limits
are taken before (``Limiter.enter``).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from dprouter.core.errors import error
from dprouter.core.tenants import Tenant
from dprouter.core.types import Caller
from dprouter.fleet.board import Board

MICRO = 1_000_000  # a bucket's level in millionths of a request or token
LEVEL, STAMP = 0, 1  # a bucket's cells: its level, and when it was last filled (ns)
REQUESTS, TOKENS = 1, 3  # where each bucket starts in a tenant's row (cell 0: its hash)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a tenant's request is refused: the limit (its option's name), a message, and
    the seconds until it would pass (the ``Retry-After``)."""

    limit: str
    message: str
    retry_after: float

    def answer(self) -> web.Response:
        wait = str(max(1, math.ceil(self.retry_after)))
        return error(429, self.message, self.limit, headers={"Retry-After": wait})


class Limiter:
    """Takes requests and tokens from tenants' buckets on ``board``."""

    def __init__(self, board: Board, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.board = board
        self.clock = clock
        self._rows: dict[str, tuple[int, int]] = {}  # tenant -> (its hash, its row): a guess

    def enter(self, tenant: Tenant) -> Refusal | None:
        """Take one request of ``tenant``'s rate and one of its in-flight places (given back
        by ``leave``), or say why not."""
        limits = tenant.limits
        if not limits.requests_per_second and not limits.in_flight:
            return None
        board = self.board
        with board.step():
            row = self._row(tenant.name)
            if row < 0:
                return crowded(tenant)
            if limits.in_flight:
                flights = board.own_flights  # one row a serving process: one cell when alone
                flying = int(flights[:, row].sum()) if board.rows > 1 else flights.item(0, row)
                if flying >= limits.in_flight:
                    message = (
                        f"tenant {tenant.name} has {flying} requests in flight, its limit "
                        f"(in_flight {limits.in_flight}); retry when one ends"
                    )
                    return Refusal("in_flight", message, 1.0)
            if limits.requests_per_second:
                wait = self._take(row, REQUESTS, 1, limits.requests_per_second, limits.burst)
                if wait:
                    message = (
                        f"tenant {tenant.name} is over its limit of "
                        f"{limits.requests_per_second:g} requests per second"
                    )
                    return Refusal("requests_per_second", message, wait)
            if limits.in_flight:
                board.own_flights[board.row, row] += 1
        return None

    def leave(self, tenant: Tenant) -> None:
        """A request of ``tenant`` let in by ``enter`` ended."""
        if not tenant.limits.in_flight:
            return
        board = self.board
        with board.step():
            row = self._row(tenant.name)
            if row >= 0:
                board.own_flights[board.row, row] -= 1

    def charge(self, tenant: Tenant, tokens: int) -> Refusal | None:
        """Take ``tokens`` (prompt + output budget) of ``tenant``'s token rate."""
        rate = tenant.limits.tokens_per_second
        if not rate:
            return None
        with self.board.step():
            row = self._row(tenant.name)
            if row < 0:
                return crowded(tenant)
            wait = self._take(row, TOKENS, tokens, rate, tenant.limits.burst)
        if not wait:
            return None
        message = (
            f"tenant {tenant.name} is over its limit of {rate:g} tokens per second "
            f"(this request counts {tokens}: prompt + max_tokens)"
        )
        return Refusal("tokens_per_second", message, wait)

    def _take(self, row: int, at: int, amount: int, rate: float, burst: float) -> float:
        """Take ``amount`` from the bucket at cell ``at`` of ``row``: 0.0 when taken, else
        the seconds until it could be. Under the board's lock."""
        cells = self.board.buckets[row]
        now = self.clock()
        per_ns = rate * MICRO / 1e9
        full = int(rate * burst * MICRO)
        stamp: int = cells.item(at + STAMP)
        level: int = cells.item(at + LEVEL) + int((now - stamp) * per_ns)
        level = min(level, full)
        need = amount * MICRO
        if level < min(need, full):  # a request above a whole bucket waits for it full
            return (min(need, full) - level) / (rate * MICRO)
        cells[at + LEVEL] = level - need
        cells[at + STAMP] = now
        return 0.0

    def _row(self, name: str) -> int:
        """``name``'s row of the board's tenants, claimed (its buckets full) when it has
        none; -1: every row is taken by a tenant with requests in flight. Under the lock:
        another process may have given this tenant's row to another since it was found."""
        buckets = self.board.buckets
        known = self._rows.get(name)
        if known is not None and buckets[known[1], 0] == known[0]:
            return known[1]
        key = name_hash(name)
        rows = len(buckets)
        start = key % rows
        free = -1
        for step in range(rows):
            row = (start + step) % rows
            held = int(buckets[row, 0])
            if held == key:
                self._rows[name] = (key, row)
                return row
            if held == 0:
                free = row
                break
        if free < 0:  # full: a row no request is in flight for goes to this tenant
            idle = np.flatnonzero(self.board.own_flights.sum(axis=0) == 0)
            if not len(idle):
                return -1
            free = int(idle[0])
        now = self.clock()
        buckets[free] = (key, 1 << 62, now, 1 << 62, now)  # full: capped at the first take
        self._rows[name] = (key, free)
        return free


def name_hash(name: str) -> int:
    """A tenant's name as a nonzero int64 (0 marks a free row)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ((1 << 63) - 1)) or 1


def crowded(tenant: Tenant) -> Refusal:
    message = (
        f"every tenant place of the router is held by a tenant with requests in flight: "
        f"tenant {tenant.name}'s limits cannot be kept; retry"
    )
    return Refusal("tenants", message, 1.0)


@dataclass(slots=True)
class Entry:
    """A request the front door let in: who sent it, and their limits, charged once its
    tokens are known. Kept in the request under ``ENTRY``."""

    caller: Caller
    tenant: Tenant
    limiter: Limiter
    label: str  # its tenant in the metrics

    def charge(self, tokens: int) -> Refusal | None:
        return self.limiter.charge(self.tenant, tokens)


ENTRY = web.RequestKey("dprouter.entry", Entry)
